"""The placement and weight-sync half of `ops/gpu-check` (issue 16): what runs on one GPU without vLLM.

- the placement planner against this machine's real device list: every shipped config, planned on
  `torch.cuda.device_count()` GPUs (an 8-GPU config on fewer GPUs must be refused with its reason) and
  on the 8 GPUs it was written for;
- the publisher packing a model (the gpu check's 1.5B-shaped learner, FSDP2-sharded) into its buckets
  on the GPU, fp32 master weights cast to bf16: seconds (median of 3) and GB/s;
- one broadcast to a receiver on the same GPU (gloo with CUDA tensors: NCCL refuses two ranks on one
  device) receiving into two rotating bucket buffers, as a TP worker does: seconds and bit-exactness;
  the learner waits by polling the collectives (no device-wide synchronize);
- a frozen receiver (joined, never receives): the send gives up after its timeout with SyncTimeout and
  the process goes on.
Receivers are threads of this process (one gloo rank each), so nothing needs spawning.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def planner_results(gpus: int) -> dict[str, str]:
    """Each shipped config planned on this machine's GPUs and on 8: the plan's table, or the refusal."""
    from exgrpo_async.config import load_config
    from exgrpo_async.placement import PlacementError, plan

    from exgrpo_async.launch import check_devices

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


def _joined(pub, key: str, device: torch.device):
    from exgrpo_async.weight_sync import WeightReceiver

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("rx", WeightReceiver(
        "127.0.0.1", pub.port, f"ws/{key}/", 1, 2, "gloo", device, 30, ring=True)))
    t.start()
    pub.open_group(key, 2)
    t.join(60)
    return box["rx"]


def sync_results(model: torch.nn.Module, device: torch.device, bucket_mb: int = 256) -> dict:
    from exgrpo_async.weight_sync import SyncTimeout, WeightPublisher

    named = list(model.named_parameters())
    pub = WeightPublisher("127.0.0.1", 0, "gloo", device, bucket_mb=bucket_mb, timeout_s=60)
    times = []
    for v in range(3):
        t0 = time.perf_counter()
        pub.publish(v, named, torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    _, meta, flat = pub.snapshot()
    nbytes = sum(b.numel() * b.element_size() for b in flat)
    res = {"publish_buckets": len(flat), "publish_bytes": nbytes, "publish_seconds": statistics.median(times),
           "publish_gb_s": nbytes / statistics.median(times) / 1e9}

    rx = _joined(pub, "live", device)
    sender = threading.Thread(target=lambda: res.setdefault("send_seconds", pub.send("live", flat)))
    t0 = time.perf_counter()
    sender.start()
    exact = True
    for i, bucket in enumerate(rx.receive(meta)):
        off = 0
        for _, t in bucket:
            n = t.numel()
            exact &= bool(torch.equal(t.reshape(-1), flat[i][off:off + n]))
            off += n
    sender.join(120)
    res.update(receive_seconds=time.perf_counter() - t0, receive_exact=exact,
               receiver_buffer_bytes=sum(b.numel() for b in rx.buffers))
    rx.close()
    pub.close_group("live")

    frozen = _joined(pub, "frozen", device)
    pub.timeout_s = 2.0
    t0 = time.perf_counter()
    try:
        pub.send("frozen", flat)
        res["frozen_send"] = "completed (unexpected)"
    except SyncTimeout as e:
        res["frozen_send"] = f"SyncTimeout after {time.perf_counter() - t0:.1f}s: {e}"
    res["frozen_group_dropped"] = "frozen" not in pub.groups
    frozen.close()
    return res
