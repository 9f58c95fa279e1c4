"""The weight-sync protocol between real processes, without vLLM: gloo on CPU always; on one GPU, gloo
with CUDA tensors (NCCL refuses two ranks on one device); on two GPUs, NCCL with the learner on cuda:0
and the actors' workers on cuda:1.

A learner-side WeightPublisher sends bucketed weights to a WeightReceiver in another process; the
receiver must get every tensor bit-exactly, across two successive versions, and a second actor's group
must work beside the first (groups are per actor). The GPU receivers use two rotating bucket buffers
(`ring`), as vLLM's GPU workers do.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from exgrpo_async.weight_sync import WeightPublisher, WeightReceiver


def named_weights(version: int, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    shapes = {"embed.weight": (300, 64), "layer.0.q.weight": (64, 64), "layer.0.norm": (64,), "head.bias": (3000,)}
    out = [(n, torch.randn(*s, generator=g).to(device)) for n, s in shapes.items()]
    out.append(("half.weight", torch.randn(128, generator=g).to(torch.bfloat16).to(device)))
    return out


def receiver_proc(port: int, key: str, backend: str, device: str, metas, results) -> None:
    rx = WeightReceiver("127.0.0.1", port, f"ws/{key}/", 1, 2, backend, torch.device(device), 60,
                        ring=device != "cpu")
    for version, meta in enumerate(metas, start=1):
        got = {name: t.cpu().clone() for bucket in rx.receive(meta) for name, t in bucket}
        ref = dict((n, t.cpu()) for n, t in named_weights(version, "cpu"))
        results.put((key, version, all(torch.equal(got[n], ref[n]) for n in ref) and got.keys() == ref.keys()))
    rx.close()


def run_sync(backend: str, learner_device: str = "cpu", actor_device: str = "cpu") -> list:
    device = torch.device(learner_device)
    pub = WeightPublisher("127.0.0.1", 0, backend, device, bucket_mb=0, timeout_s=60)
    pub.bucket_bytes = 8 << 10  # several buckets, so the receive overlap path runs
    metas = []
    for v in (1, 2):
        pub.publish(v, named_weights(v, str(device)))
        metas.append(pub.snapshot()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=receiver_proc, args=(pub.port, k, backend, actor_device, metas, results))
             for k in ("a", "b")]
    for p in procs:
        p.start()
    for key in ("a", "b"):
        pub.open_group(key, 2)
    for v in (1, 2):
        pub.publish(v, named_weights(v, str(device)))
        _, _, flat = pub.snapshot()
        threads = [threading.Thread(target=pub.send, args=(k, flat)) for k in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    out = sorted(results.get(timeout=60) for _ in range(4))
    for p in procs:
        p.join(30)
    pub.close_group("a")
    pub.close_group("b")
    return out


EXPECTED = [("a", 1, True), ("a", 2, True), ("b", 1, True), ("b", 2, True)]


def test_gloo_groups_deliver_every_tensor_exactly():
    assert run_sync("gloo") == EXPECTED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_gpu_gloo_groups_deliver_cuda_tensors_exactly():
    assert run_sync("gloo", "cuda:0", "cuda:0") == EXPECTED


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
def test_nccl_groups_deliver_every_tensor_exactly():
    assert run_sync("nccl", "cuda:0", "cuda:1") == EXPECTED
