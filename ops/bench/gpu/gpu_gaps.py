"""Where a GPU step waits on its host: the synchronising calls and the idle time between kernels.

Two views of one learner step, for the GPU check's profile section (ops/bench/gpu/gpu_check_sections.py):
- `sync_sites(fn)`: run `fn` under torch's CUDA sync debug mode and count every synchronising call by
  the innermost line of this repository's code that made it (a sync lets the device run dry while the
  host catches up);
- `idle_gaps(trace)`: from a profiler's Chrome trace (CPU and CUDA activities), the device's busy and
  idle time over the step's window, and the idle time before each kernel charged to what launched it:
  the learner's phase (`learner.maths.result.Phase` labels its blocks `exgrpo.<phase>`) and the innermost
  aten op around the launch; and the host's waits in synchronising runtime calls, by the same keys.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
from bench import REPO  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
WAITS = ("Synchronize", "cudaMemcpy", "cuMemcpy")


def sync_sites(fn, top: int = 12) -> dict:
    """Synchronising CUDA calls made while `fn()` runs, counted by the innermost frame in this repo."""
    if not torch.cuda.is_available():
        fn()
        return {"skipped": "needs CUDA"}
    sites: dict[str, int] = {}
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return old_show(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        if stack and stack[-1].filename == __file__:
            return  # this function's own switch of the mode, not `fn`'s
        frames = [f for f in stack if f.filename.startswith(str(REPO)) and f.filename != __file__]
        f = frames[-1] if frames else None
        key = f"{Path(f.filename).relative_to(REPO)}:{f.lineno} {f.name}" if f else f"{filename}:{lineno}"
        sites[key] = sites.get(key, 0) + 1

    old_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.set_sync_debug_mode(old_mode)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(old_mode)
            warnings.showwarning = old_show
    return {"total": sum(sites.values()), "sites": dict(sorted(sites.items(), key=lambda x: -x[1])[:top])}


def trace_of(fn, keep: Path | None = None) -> dict:
    """Chrome trace (a dict) of `fn()` under the profiler, CPU and CUDA; a gzipped copy at `keep`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        raw = Path(path).read_bytes()
    finally:
        os.unlink(path)
    if keep is not None:
        keep.write_bytes(gzip.compress(raw, 6))
    return json.loads(raw)


class _Enclosing:
    """The innermost of one thread's nested host events that contains a time (events sorted by start)."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def at(self, ts: float) -> str | None:
        i = bisect.bisect_right(self.starts, ts) - 1
        for e in reversed(self.events[max(0, i - 200):i + 1]):  # nested: the latest start that contains ts
            if e["ts"] <= ts <= e["ts"] + e.get("dur", 0):
                return e["name"]
        return None


def idle_gaps(trace: dict, min_gap_us: float = 5.0, top: int = 15) -> dict:
    """The device's busy and idle time over the trace's kernels, and the idle time charged to what
    launched the kernel after each gap (phase label / aten op); host waits in synchronising calls."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in ev if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not device:
        return {}
    launches = {e["args"]["correlation"]: e for e in ev if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    labels, ops = {}, {}
    for e in ev:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("exgrpo."):
            labels.setdefault(e["tid"], []).append(e)
        elif e.get("cat") == "cpu_op":
            ops.setdefault(e["tid"], []).append(e)
    labels = {t: _Enclosing(x) for t, x in labels.items()}
    ops = {t: _Enclosing(x) for t, x in ops.items()}

    def site(e: dict) -> str:
        lab = labels.get(e["tid"]).at(e["ts"]) if e["tid"] in labels else None
        op = ops.get(e["tid"]).at(e["ts"]) if e["tid"] in ops else None
        return f"{lab or 'outside phases'} / {op or e['name']}"

    busy, idle, end = 0.0, {}, device[0]["ts"]
    gaps = 0
    for d in device:
        gap = d["ts"] - end
        if gap > min_gap_us:
            gaps += 1
            launch = launches.get(d.get("args", {}).get("correlation"))
            key = site(launch) if launch else "unknown launch"
            idle[key] = idle.get(key, 0.0) + gap
        busy += max(0.0, d["ts"] + d["dur"] - max(end, d["ts"]))
        end = max(end, d["ts"] + d["dur"])
    waits: dict[str, float] = {}
    for e in ev:
        if e.get("cat") in LAUNCH_CATS and any(w in e.get("name", "") for w in WAITS) and e.get("dur", 0) > 50:
            k = site(e) + f" ({e['name']})"
            waits[k] = waits.get(k, 0.0) + e["dur"]
    window = end - device[0]["ts"]
    ms = lambda d: {k: round(v / 1e3, 3) for k, v in sorted(d.items(), key=lambda x: -x[1])[:top]}  # noqa: E731
    return {"window_ms": round(window / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_ms": round((window - busy) / 1e3, 3), "gaps": gaps, "idle_ms_by_launch": ms(idle),
            "host_waits_ms": ms(waits)}
