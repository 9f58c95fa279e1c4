"""What one step's update reports (`UpdateResult`), how its phases are timed (`Phase`), and the one
transfer that brings its device-side statistics to the host at the step's end (`finish_result`).

The update (learner/maths/update.py) keeps losses, micro-batch statistics, KL sums and pi_past as device
tensors while it runs, so the step never waits on the device; `read_phases` and `finish_result` read them
once, after the last optimizer update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class UpdateResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer update (mini-batch)
    norms: list[float] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)  # one per micro-batch
    kl: dict = field(default_factory=lambda: {"mismatch": [0.0, 0], "behaviour": [0.0, 0]})  # k3 sums, tokens
    diff_max: float | None = None  # max |logp_vllm - logp_learner| on tokens of the learner's own version
    pi_past: dict[int, torch.Tensor] = field(default_factory=dict)  # seq index -> pre-update log-probs
    updates: int = 0  # optimizer updates made
    skipped: int = 0  # optimizer updates skipped (bad grad norm)
    # this rank's seconds per phase: the no-grad pre-update recompute, forwards (with the loss), backwards,
    # optimizer updates (clip and step); on CUDA from events on the compute stream, read once per step
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    events: list = field(default_factory=list, repr=False)  # (phase, start, end) CUDA events not yet read


PHASES = ("recompute", "forward", "backward", "optimizer")


class Phase:
    """Adds the time of a `with` block to `res.seconds[name]`: the wall clock on CPU; on CUDA, events
    recorded on the current stream (no device-wide synchronize in the step; `read_phases` reads them).
    The block is labelled `exgrpo.<name>` for the profiler (ops/bench/gpu/gpu_gaps.py reads the labels)."""

    def __init__(self, res: UpdateResult, name: str, device: torch.device):
        self.res, self.name, self.cuda = res, name, device.type == "cuda"
        self.label = torch.profiler.record_function(f"exgrpo.{name}")

    def __enter__(self) -> None:
        self.label.__enter__()
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.res.events.append((self.name, self.start, end))
        else:
            self.res.seconds[self.name] += time.perf_counter() - self.t0
        self.label.__exit__(*exc)


def read_phases(res: UpdateResult) -> None:
    """Turn the step's CUDA phase events into seconds (waits for the last one only)."""
    if res.events:
        res.events[-1][2].synchronize()
        for name, start, end in res.events:
            res.seconds[name] += start.elapsed_time(end) / 1000.0
        res.events.clear()


def finish_result(res: UpdateResult) -> None:
    """Read the step's statistics off the device in one transfer: losses, micro-batch stats, KL sums,
    the max log-prob diff and the collected pi_past become host numbers."""
    tensors = [t for t in res.losses if isinstance(t, torch.Tensor)]
    tensors += [v for st in res.stats for v in st.values() if isinstance(v, torch.Tensor)]
    tensors += [v for pair in res.kl.values() for v in pair if isinstance(v, torch.Tensor)]
    if isinstance(res.diff_max, torch.Tensor):
        tensors.append(res.diff_max)
    at = tensors[0].device if tensors else None
    values = iter(torch.stack([t.detach().double().reshape(()).to(at) for t in tensors]).tolist() if tensors else [])
    host = lambda v: next(values) if isinstance(v, torch.Tensor) else v
    res.losses = [host(v) for v in res.losses]
    res.stats = [{k: host(v) for k, v in st.items()} for st in res.stats]
    kl = {k: [host(a), host(b)] for k, (a, b) in res.kl.items()}
    res.kl = {k: [a, int(b)] for k, (a, b) in kl.items()}
    if res.diff_max is not None:
        d = host(res.diff_max)
        res.diff_max = d if d >= 0 else None
    if res.pi_past:  # one transfer
        keys = list(res.pi_past)
        on_host = torch.cat([res.pi_past[i] for i in keys]).cpu().split([len(res.pi_past[i]) for i in keys])
        res.pi_past = dict(zip(keys, on_host))
