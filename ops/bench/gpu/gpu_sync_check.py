"""The placement and weight-sync part of `ops/gpu-check` (section sync): what one GPU can show without vLLM.

- `planner_results`: every shipped config planned on this machine's GPUs and on the 8 it was written
  for (an 8-GPU config on fewer GPUs must be refused with its reason);
- `publish_rate`: the publisher packing a model's fp32 master weights into bf16 buckets on the device:
  seconds (median of 3) and GB/s;
- `receive_hazard`: the receiver's buckets against a loader that keeps a view of one tensor of each bucket
  until the next bucket has arrived (vLLM's layerwise reload holds a fused layer's first tensors until its
  last one comes, and a 7B gate/up pair spans two 256 MiB buckets). The broadcasts run as NCCL runs
  them: on a stream of their own, ordered after the work already queued on the caller's stream, the
  caller's stream waiting for each one it reads. `WeightReceiver.receive` as committed (a fresh buffer
  per bucket) against the two rotating buffers it used before: elements read wrong by the loader.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
from bench import REPO  # noqa: E402


def planner_results(gpus: int) -> dict[str, str]:
    """Each shipped config planned on this machine's GPUs and on 8: the plan's table, or the refusal."""
    from exgrpo_async.config_io import load_config
    from exgrpo_async.launcher.placement import PlacementError, plan
    from exgrpo_async.launcher.train import check_devices

    out = {}
    for path in sorted((REPO / "configs").glob("*.toml")):
        for n in sorted({gpus, 8}):
            try:
                p = plan(load_config(path, [f"placement.gpus={n}"]), n)
                if n == gpus:  # what `train` checks against the devices it sees
                    check_devices(p, gpus)
                out[f"{path.name} on {n}"] = "CPU run" if p is None else p.table().replace("\n", "; ")
            except PlacementError as e:
                out[f"{path.name} on {n}"] = f"refused: {e}"
    return out


def publish_rate(model: torch.nn.Module, device: torch.device, bucket_mb: int = 256) -> dict:
    from exgrpo_async.weight_sync import WeightPublisher

    named = list(model.named_parameters())
    pub = WeightPublisher("127.0.0.1", 0, "nccl" if device.type == "cuda" else "gloo", device, bucket_mb=bucket_mb,
                          timeout_s=60)
    times = []
    for v in range(3):
        t0 = time.perf_counter()
        pub.publish(v, named, torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    _, _, flat = pub.snapshot()
    nbytes = sum(b.numel() * b.element_size() for b in flat)
    return {"buckets": len(flat), "bytes": nbytes, "seconds": statistics.median(times),
            "gb_s": nbytes / statistics.median(times) / 1e9, "sets": len(pub._sets)}


class _Work:
    def __init__(self, done: torch.cuda.Event):
        self.done = done

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)

    def is_completed(self) -> bool:
        return self.done.query()


class StreamGroup:
    """Broadcasts (rank 1's side) as ProcessGroupNCCL orders them: on the group's own stream, after what the
    caller's stream had queued when the call was made; the buffer's memory recorded on that stream."""

    def __init__(self, device: torch.device, sources: list[torch.Tensor]):
        self.stream = torch.cuda.Stream(device)
        self.sources = iter(sources)

    def broadcast(self, tensors, opts):
        buf, src = tensors[0], next(self.sources)
        queued = torch.cuda.Event()
        queued.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(queued)
            buf.copy_(src)
            done = torch.cuda.Event()
            done.record()
        buf.record_stream(self.stream)
        return _Work(done)


def _two_slot_buffer(self, i: int, dtype: str, n: int) -> torch.Tensor:
    """WeightReceiver's GPU buffers before 2026-11-26: two bucket-sized slots used in turn."""
    dt = getattr(torch, dtype)
    if len(self._bufs) < 2:
        self._bufs = [torch.empty(self._most, dtype=torch.uint8, device=self.device) for _ in range(2)]
    return self._bufs[i % 2][:n * dt.itemsize].view(dt)


def receive_hazard(device: torch.device, buckets: int = 6, numel: int = 1 << 22, busy_cycles: int = 50_000_000) -> dict:
    from exgrpo_async.weight_sync import WeightReceiver

    g = torch.Generator(device=device).manual_seed(0)
    half = numel // 2
    meta = [[(f"layers.{i}.up_proj.weight", "bfloat16", [half]), (f"layers.{i + 1}.gate_proj.weight", "bfloat16",
                                                                   [half])] for i in range(buckets)]
    out = {}
    for mode in ("fresh (committed)", "two slots (before)"):
        sources = [torch.randn(numel, generator=g, device=device).bfloat16() for _ in range(buckets)]
        rx = WeightReceiver.__new__(WeightReceiver)
        rx.device, rx.ring, rx._bufs, rx._plan, rx._most = device, True, [], [], numel * 2
        if mode.startswith("two"):
            rx._buffer = _two_slot_buffer.__get__(rx)
        wrong = {"immediate": 0, "deferred": 0}
        for consumer in ("immediate", "deferred"):
            rx.pg = StreamGroup(device, sources)
            dest = [torch.empty(numel, dtype=torch.bfloat16, device=device) for _ in range(buckets)]
            held = None
            for i, bucket in enumerate(rx.receive(meta)):
                (_, up), (_, gate) = bucket
                dest[i][:half].copy_(up)
                if consumer == "immediate":
                    dest[i][half:].copy_(gate)
                    continue
                torch.cuda._sleep(busy_cycles)  # the loader's own work on this layer, on the caller's stream
                if held is not None:  # the previous bucket's gate half waited for this bucket (its up half)
                    held[0][half:].copy_(held[1])
                held = (dest[i], gate)
            if held is not None:
                held[0][half:].copy_(held[1])
            torch.cuda.synchronize(device)
            wrong[consumer] = int(sum(int((d != s).sum()) for d, s in zip(dest, sources)))
        out[mode] = {"elements_read_wrong": wrong, "elements": buckets * numel}
    return out
