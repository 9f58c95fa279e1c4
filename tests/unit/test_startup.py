"""exgrpo_async/startup.py: the collector off for a block of start-up work, its garbage freed, the rest frozen."""

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

from exgrpo_async.startup import without_gc

REPO = Path(__file__).resolve().parents[2]


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_block_runs_without_the_collector_then_its_garbage_is_freed_and_the_rest_frozen():
    gc.unfreeze()
    try:
        kept = _Node()
        with without_gc():
            assert not gc.isenabled()
            with without_gc():  # nested: the outer block turns it back on
                pass
            assert not gc.isenabled()
            dropped = weakref.ref(_Node())  # cyclic garbage made inside the block
            alive = _Node()
            assert dropped() is not None  # nothing collected it while the block ran
        assert gc.isenabled()
        assert dropped() is None  # the block's garbage was collected, not frozen
        assert gc.get_freeze_count() > 0
        frozen = weakref.ref(alive)
        del alive, kept
        gc.collect()
        assert frozen() is not None  # frozen: no collection scans it
    finally:
        gc.unfreeze()
        gc.collect()
    assert frozen() is None  # unfrozen, it is collected again


def test_with_the_collector_off_the_block_leaves_it_off_and_freezes_nothing():
    before = gc.get_freeze_count()  # what this process froze earlier (an in-process engine's start)
    gc.disable()
    try:
        with without_gc():
            _Node()
        assert not gc.isenabled() and gc.get_freeze_count() == before
    finally:
        gc.enable()


def test_a_process_that_froze_its_start_up_exits_quietly():
    """Unfrozen at exit, so the interpreter's last collection frees it (a frozen Triton import made
    nanobind print "leaked" lines at every normal exit)."""
    code = ("from exgrpo_async.startup import without_gc\n"
            "with without_gc():\n    import torch._inductor.runtime.triton_compat\n"
            "import gc; assert gc.get_freeze_count() > 0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_the_start_up_bench_measures_both_ways(tmp_path):
    """ops/bench/system/startup_gc.py, its cheapest role once: both ways measured in fresh processes, and after
    `without_gc` a full collection finds the start-up frozen (it scans almost nothing)."""
    out = tmp_path / "startup_gc.json"
    proc = subprocess.run([sys.executable, str(REPO / "ops/bench/system/startup_gc.py"), "--roles", "verifier",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())["roles"]["verifier"]
    assert row["gc_on"]["modules"] == row["without_gc"]["modules"] > 100  # the same imports either way
    assert row["without_gc"]["full_collection_s"] < 0.2 * row["gc_on"]["full_collection_s"]
    assert row["block_ratio"] == row["without_gc"]["block_s"] / row["gc_on"]["block_s"]
