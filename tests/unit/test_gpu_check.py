"""ops/gpu-check rehearsed on CPU at toy shapes: every section runs the code it runs on a GPU (CUDA-only
parts say they were skipped), writes its JSON, and the figures that do not depend on the device hold."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import load_bench

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_gpu_check_runs_every_section_on_cpu(tmp_path):
    # with the Inductor mode vLLM's CPU platform puts in a process's environment: the regions' guard
    # (learner/maths/compiled.py `fixed_cpu_threads`) still speaks; test_compiled.py runs it under Inductor
    env = {**os.environ, "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    # The compiled variants traced (Dynamo, AOTAutograd, the checkpoint in the graph) without Inductor's C++
    # kernels, which a GPU never runs (Triton there) and test_compiled.py checks on CPU: 40 s alone on the idle
    # Xeon against 97 s with Inductor from a cold cache; 138-156 s at the AVX2-only pace (2026-11-28)
    proc = subprocess.run([sys.executable, str(REPO / "ops/bench/gpu/gpu_check.py"), "--device", "cpu", "--tiny",
                           "--steps", "1", "--compile-backend", "aot_eager", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=450, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1 ignored" in proc.stderr
    whole = json.loads((tmp_path / "gpu_check.json").read_text())
    res = whole["sections"]
    assert whole["compile_backend"] == "aot_eager"
    assert list(res) == load_bench("gpu/gpu_check").SECTIONS
    assert not [name for name, r in res.items() if "error" in r], {n: r.get("error") for n, r in res.items()}
    assert res["imports"]["all_ok"] is True
    for mix in ("4_equal", "mixed"):  # fp32 on CPU: packed rows score as each sequence alone
        for backend in ("sdpa", "per_sequence"):
            assert res["attention"][mix][backend]["max_abs_dlogp_vs_alone"] < 1e-4
    assert res["attention"]["start_up_check_per_sequence"] == "passed"
    assert res["kernels"]["sdpa_per_sequence"]["fwd_bwd_ms"] > 0  # the code path only on CPU (ops/bench/gpu/gpu_kernels.py)
    assert res["fingerprint"]["all_exact"] is True
    steps = {k: v for k, v in res["step_1.5b"].items() if isinstance(v, dict)}
    assert len(steps) == 7 and all(v["tokens_per_s"] > 0 for v in steps.values())  # FSDP2 compiled without
    # checkpointing and sdpa only on request; no "_ww" variant on CPU (fp32 compute), nor FSDP2
    # compiled under checkpointing (ops/bench/gpu/gpu_check_sections.py: an Inductor assertion on CPU)
    compiled = [k for k in steps if "_compiled_" in k]  # learner/maths/compiled.py
    assert len(compiled) == 4 and all(steps[k]["compiled_graphs"] > 0 for k in compiled)
    assert all(steps[k]["graphs_compiled_while_timed"] == 0 for k in compiled)  # warmed up until nothing new compiles
    # fp32 on CPU, the same batch and weights: the compiled steps (the one checkpointed inside its layers'
    # graphs too) take the eager step (measured: 1e-5 to 3e-4 apart, the losses being sums that cancel)
    assert all(steps[k]["match_vs_eager"] < 1e-3 for k in compiled), {k: steps[k]["match_vs_eager"] for k in compiled}
    eager = [steps[f"{w}_per_sequence_fused"]["first_step"]["losses"] for w in ("unsharded", "fsdp2")]
    assert eager[0] == eager[1]  # the weights did not move between the variants (lr 1e-30)
    assert "tokens_per_s" in res["profile"]["compiled_no_checkpointing"] and "partial" not in res["profile"]
    assert "compiled_head_checkpointing" not in res["profile"]  # on request only: step_1.5b measures it
    assert "tokens_per_s" in res["profile"]["compiled_checkpointing"]
    assert res["profile"]["host_syncs_compiled_no_checkpointing"] == {"skipped": "needs CUDA"}
    assert (tmp_path / "trace-compiled_no_checkpointing.json.gz").stat().st_size > 1000  # the profiler's trace
    assert res["memory_7b"]["publish_sets_after_two"] == 1  # issue 33, A1: one set on a GPU, repacked in place
    load = res["load"]  # the learner ranks' load from rank 0 gives the checkpoint exactly, ties kept
    assert (load["tensors_differing"], load["on_device"], load["tied_kept"]) == (0, True, True) and load["tensors"] > 0
    assert res["sync"]["receive_hazard"] == "skipped: needs CUDA streams" and "skipped" in res["stall"]


def test_every_section_has_its_function():
    """gpu_check.py runs a section by its name in SECTIONS (dots and dashes dropped) from gpu_check_sections.py."""
    sections = load_bench("gpu/gpu_check_sections")
    missing = [s for s in load_bench("gpu/gpu_check").SECTIONS if not callable(getattr(sections, s.replace(".", "")
                                                                                             .replace("-", "_"), None))]
    assert not missing


def test_sync_section_plans_every_shipped_config():
    """gpu_sync_check.py's placement part (the sync section's first figure), on a machine without GPUs: each
    shipped config on 0 GPUs and on the 8 it was written for, a plan's table, a CPU run, or a refusal."""
    got = load_bench("gpu/gpu_sync_check").planner_results(0)
    configs = sorted(p.name for p in (REPO / "configs").glob("*.toml"))
    assert sorted(got) == sorted(f"{c} on {n}" for c in configs for n in (0, 8))
    assert got["cpu-demo.toml on 0"] == "CPU run"
    for c in configs:
        if "8gpu" in c:  # written for 8 GPUs: planned there, a table of its processes
            assert not got[f"{c} on 8"].startswith(("refused", "CPU run")) and "GPU" in got[f"{c} on 8"], got


def test_kernels_section_draws_rows_and_counts_causal_work():
    """ops/bench/gpu/gpu_kernels.py's pure parts: the row's sequences fill it exactly, and the causal FLOPs
    are the lower triangle's (2 L^2 d h forward, 2.5 times that backward)."""
    k = load_bench("gpu/gpu_kernels")
    lengths = k.row_lengths(16384, (100, 600), (200, 3072), seed=5)
    assert sum(lengths) == 16384 and len(lengths) > 3 and max(lengths) <= 3672
    assert k.row_lengths(16384, (100, 600), (200, 3072), seed=5) == lengths  # seeded
    fwd, bwd = k.causal_flops([3, 5], heads=2, dim=4)
    assert (fwd, bwd) == (2 * (9 + 25) * 4 * 2, 2.5 * 2 * (9 + 25) * 4 * 2)
