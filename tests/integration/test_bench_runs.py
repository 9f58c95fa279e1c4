"""Tiny real runs of the benchmarks that drive `exgrpo-async train` or the demo (ops/bench/learning/ and
ops/bench/system/pipeline.py): each script end to end at the smallest size that still takes its every
step (runs, evaluations, the figures and the JSON), so a change to the CLI, the config or the run folder
that breaks a benchmark fails here, not at the next measurement. The figures of these runs mean nothing;
their shape and their internal arithmetic are what is checked. peer.py runs its own side only: TRL's runs
need the peer harness's own virtual environment (../shared/tools/peer/README.md), which the project does not
install; the harness's evaluator, which scores our checkpoints, runs in this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import PINNED_PRECISION, TOY, TOY_CACHE

pytestmark = pytest.mark.slow  # real runs: 20-60 s each on 2 cores

REPO = Path(__file__).resolve().parents[2]
# the smallest batch the loop takes: 4 questions x 2 samples, one actor
TINY = [*TOY, *PINNED_PRECISION, "learner.questions_per_step=4", "rollout.samples_per_question=2",
        "rollout.questions_per_request=4", "actor.num_actors=1"]


def bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, f"ops/bench/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_pipeline_bench_tiny_run(toy, tmp_path):
    """The synchronous baseline alone, 2 steps (the first not timed): the overlap bound is computed from it
    and the run does not pass it (every eta takes the same path; two runs cost twice the start-up)."""
    out = tmp_path / "pipeline.json"
    proc = bench("system/pipeline.py", "--steps", "2", "--skip", "1", "--etas", "0", "--out", str(out), *TINY)
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"0"} and res["bound_violated"] is False and res["pass"] is False  # no eta=1
    assert 0 < res["results"]["0"]["of_bound"] <= 1.0 and res["pure"]["ideal_step_seconds"] > 0
    assert "eta=0 step" in proc.stdout and "target: eta=1 >= 90% of the bound: NOT met" in proc.stdout


def test_learning_bench_tiny_run(toy, tmp_path):
    """One arm, one seed, a token budget of a few steps, evaluated at start, midway and end on 1 held-out
    question of each kind: the curve on the token grid, and the arm's summary."""
    bench("learning/learning.py", "--scenario", "demo", "--arms", "grpo", "--seeds", "0", "--tokens", "600",
          "--eval-every", "300", "--heldout-per-kind", "1", "--out", str(tmp_path), *TINY)
    res = json.loads((tmp_path / "learning-demo.json").read_text())
    (run,) = res["runs"]
    tokens = [t for t, _, _ in run["points"]]  # (generated tokens, sampled, greedy): start, each evaluation, end
    assert run["arm"] == "grpo" and len(tokens) >= 3 and tokens[0] == 0 and tokens[-1] >= 600, run["points"]
    assert tokens == sorted(tokens) and all(0.0 <= a <= 1.0 and 0.0 <= g <= 1.0 for _, a, g in run["points"])
    assert "result" in res and run["steps"] >= 2
    assert (tmp_path / "learning-demo.png").stat().st_size > 1000


def test_pass_rates_bench_tiny_run(toy, tmp_path):
    """Two questions of each kind, 2 samples each, on the warm start: a histogram over 0..2 per kind."""
    out = tmp_path / "pass_rates.json"
    bench("learning/pass_rates.py", "--per-kind", "2", "--samples", "2", "--cache-dir", str(TOY_CACHE), "--out", str(out))
    (policy,) = json.loads(out.read_text())["policies"].values()
    assert policy["all"]["questions"] == 2 * len(policy["by_kind"]) and set(policy["all"]["histogram"]) == {"0", "1", "2"}
    assert sum(policy["all"]["histogram"].values()) == policy["all"]["questions"]


def test_demo_seeds_bench_tiny_run(toy, held_out, tmp_path):
    """`./ops/demo` itself (its set-up finds this install), once, 2 steps, evaluated on 10 questions: the
    gain with its paired standard error, and the CPU it ran on, in the JSON."""
    evals = tmp_path / "held-out-10.jsonl"
    evals.write_text("".join(held_out.read_text().splitlines(keepends=True)[:10]))
    bench("learning/demo_seeds.py", "--seeds", "0", "--out", str(tmp_path), "--tag", "tiny", *TINY,
          "learner.max_steps=2", f"data.eval_file={evals}", "metrics.port=none")
    res = json.loads((tmp_path / "demo-seeds-tiny.json").read_text())
    (run,) = res["runs"]
    assert run["steps"] == 2 and set(run["gain"]) >= {"sampled", "sampled_se", "greedy", "greedy_se"}
    assert run["gain"]["sampled"] == pytest.approx(run["after"] - run["before"])
    assert res["cpu"]["flags"] and "avx2" in res["cpu"]["flags"]


HARNESS = REPO.parent / "shared" / "tools" / "peer" / "trl_toy.py"


def test_peer_bench_tiny_run_of_ours(toy, held_out, tmp_path):
    """Our side of the TRL comparison: a 2-step run checkpointed at step 2, the checkpoint scored by the peer
    harness's evaluator (transformers, 1 sample, 10 held-out questions); no TRL side, so no ratio."""
    if not HARNESS.exists():  # a visible skip, or under CI (which has ../shared beside the clone) a failure
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the peer harness is not at {HARNESS}")
    evals = tmp_path / "held-out-10.jsonl"
    evals.write_text("".join(held_out.read_text().splitlines(keepends=True)[:10]))
    out = tmp_path / "peer"
    bench("learning/peer.py", "--systems", "ours", "--seeds", "0", "--steps", "2", "--every", "2",
          "--peer-py", sys.executable, "--harness", str(HARNESS), "--src-cache", str(TOY_CACHE),
          "--eval-args", f"--eval hf --eval-samples 1 --test-file {evals}", "--out", str(out), *TINY,
          "data.eval_file=none")  # the run's own evaluations (the demo's 1,000 questions) are not the bench's
    res = json.loads((out / "peer.json").read_text())
    ((point,),) = res["runs"]["ours"]
    assert point["step"] == 2 and point["seconds"] > 0 and 0.0 <= point["accuracy"] <= 1.0
    assert point["tokens_generated"] > 0 and res["time_to_trl"] == {"ours": None}
