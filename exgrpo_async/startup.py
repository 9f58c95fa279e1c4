"""Job: a process's heavy start-up (torch, transformers, vLLM, math-verify) without Python's cyclic garbage collector.

Those libraries import thousands of modules (`from vllm import LLM`: about 4,700), and what the imports build
(modules, classes, functions) lives until the process exits. The collector, which runs every few hundred
allocations, scans it again and again and finds almost nothing to free: about a fifth of an import's time
(`from vllm import LLM` with the collector on, then off throughout: 4.9 and 3.9 s of a core on the Xeon).
And once the imports are done, every full collection of the run scans them again. `without_gc()` turns the
collector off for a block of start-up work; after it, one young-generation pass frees the block's own cyclic
garbage, everything still alive is frozen (`gc.freeze`: never scanned again, so later collections cost what
the run's own objects cost) and the collector is turned back on. An actor's start-up takes 0.87 of its CPU
time this way, a learner rank's 0.88, and a one-actor 4-step `train` run's processes 0.84 of their user CPU
(docs/benchmarks.md, "Start-up without the garbage collector"). At a normal exit the frozen objects are
unfrozen, so the interpreter's last collection frees them (nanobind, in Triton, reports objects still alive
then as leaks). Used around each role's imports and engine start: actors (actors/main.py, actors/engine.py),
learner ranks (the CLI, learner/main.py), verifier workers (actors/verifier.py), the GPU check.
"""

from __future__ import annotations

import atexit
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_gc() -> Iterator[None]:
    """The block runs with the collector off; then its garbage is collected and what is alive is frozen.
    Nested, or with the collector already off, the block runs as it is (the outer block, or the caller,
    turns it back on)."""
    if not gc.isenabled():
        yield
        return
    _unfreeze_at_exit()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)  # the block's objects are all young: none was collected while it ran
        gc.freeze()
        gc.enable()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
