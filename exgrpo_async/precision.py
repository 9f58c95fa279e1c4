"""bf16 where this machine computes it fast: resolves `model.dtype="auto"` and `learner.mixed_precision="auto"`.

The two settings are one decision: the actors generate in bf16 (vLLM) and the learner computes its
forward and backward under bf16 autocast, or both stay in fp32. The learner's master weights, gradients
and AdamW state are fp32 either way, and log-probs and entropies are reduced in fp32.
- GPU: bf16 when the device supports it (every GPU the recipes target does).
- CPU: bf16 when the CPU has native bf16 dot products (avx512_bf16 or AMX on x86, the bf16 feature on
  Arm) and a short probe on this machine, a linear layer's forward and backward in both dtypes, finds
  bf16 at most `PROBE_RATIO` of fp32's time. Without native support bf16 is emulated; with it, bf16
  has not been faster on every machine (docs/benchmarks.md, "bf16 where the machine computes it fast").
`train` resolves it once at launch (config.json records the result); a standalone learner resolves it
on rank 0 and hands the result to the other ranks.

An ordinary CPU on demand: with `ATEN_CPU_CAPABILITY=avx2` (or `default`), torch's own cap on its
kernels, this machine is taken for an AVX2-only one: no native bf16 whatever /proc/cpuinfo says, and
the actors load vLLM's AVX2 kernels (`avx2_only`; ops/avx2 sets it with oneDNN's and MKL's caps).
"""

from __future__ import annotations

import os
import platform
import time

from exgrpo_async.config import RunConfig

PROBE_RATIO = 0.8  # bf16 must take at most this share of fp32's time in the probe
_X86_FLAGS = {"avx512_bf16", "amx_bf16"}
_AVX2_CAPS = {"default", "avx2"}  # ATEN_CPU_CAPABILITY values below AVX-512


def avx2_only() -> bool:
    """Whether torch's kernels are capped at AVX2 or below (`ATEN_CPU_CAPABILITY`): the run then acts as
    on an AVX2-only CPU (fp32, vLLM's AVX2 build), as ops/avx2 asks."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in _AVX2_CAPS


def visible_flags(flags: set[str]) -> set[str]:
    """`flags` less AVX-512 and AMX when torch's kernels are capped at AVX2 (`avx2_only`)."""
    return {f for f in flags if not f.startswith(("avx512", "amx"))} if avx2_only() else flags


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's text (x86 "flags", Arm "Features"), first processor."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_cpu_bf16(flags: set[str], machine: str) -> bool:
    """Whether a CPU with these flags computes bf16 dot products in hardware."""
    if machine in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & _X86_FLAGS)


def probe_bf16_ratio(hidden: int = 256, tokens: int = 2048, reps: int = 7) -> float:
    """The fastest of `reps` runs of a linear layer's forward and backward (hidden -> 4 x hidden over
    `tokens` rows) under bf16 autocast over the fastest of as many in fp32, on one thread (the demo
    learner's). The two alternate, and the fastest run of each is the one least slowed by whatever else
    the machine is doing, so the ratio is the hardware's."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        layer = torch.nn.Linear(hidden, 4 * hidden)
        x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)

        def one(bf16: bool) -> float:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = layer(x)
            y.float().square().mean().backward()
            return time.perf_counter() - t0

        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * reps + 2):
            bf16 = bool(i % 2)
            t = one(bf16)
            if i >= 2:  # the first of each warms up
                times[bf16].append(t)
    finally:
        torch.set_num_threads(threads)
    return min(times[True]) / min(times[False])


def bf16_is_fast(gpus: int) -> bool:
    """The decision: bf16 on a GPU node that supports it; on CPU, native bf16 and the probe agreeing."""
    import torch

    if gpus:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    if not native_cpu_bf16(visible_flags(cpu_flags(text)), platform.machine()):
        return False
    return probe_bf16_ratio() <= PROBE_RATIO


def needs_resolving(cfg: RunConfig) -> bool:
    return cfg.model.dtype == "auto" or cfg.learner.mixed_precision == "auto"


def apply(cfg: RunConfig, bf16: bool) -> RunConfig:
    """`cfg` with its "auto" precision settings set to bf16 (`bf16`) or fp32; explicit ones kept."""
    if not needs_resolving(cfg):
        return cfg
    cfg = cfg.model_copy(deep=True)
    if cfg.model.dtype == "auto":
        cfg.model.dtype = "bfloat16" if bf16 else "float32"
    if cfg.learner.mixed_precision == "auto":
        cfg.learner.mixed_precision = "bf16" if bf16 else "none"
    return cfg


def resolve(cfg: RunConfig, gpus: int) -> RunConfig:
    """`cfg` with "auto" precision chosen for this machine (`gpus`: GPUs the run places processes on)."""
    return apply(cfg, bf16_is_fast(gpus)) if needs_resolving(cfg) else cfg
