"""The real entry point end to end: `exgrpo-async train` with a learner and 2 vLLM actor processes.

Short runs on the toy task (a 5-second warm start; learning itself is shown by the demo, not here):
versions advance once per step, rewards and losses are finite, every metrics field is present, the
final model loads in transformers, and SIGTERM stops every child process.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIELDS = {"step", "policy_version", "reward_mean", "pass_at_1", "loss", "grad_norm", "tokens_generated", "rollouts",
          "staleness_mean", "staleness_max", "sync_seconds", "step_seconds"}


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "exgrpo_async.cli", *args]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("toycache")
    return [f"toy.cache_dir={cache}", "toy.sft_seconds=5", "learner.questions_per_step=8",
            "rollout.samples_per_question=4", "rollout.questions_per_request=4", "rollout.eval_samples=1"]


def children_of(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        kids = (task / "children").read_text().split()
        for k in map(int, kids):
            out |= {k} | children_of(k)
    return out


def test_train_runs_end_to_end(small, tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.run(cli(["train", *small, "learner.max_steps=3", f"output_dir={out}"]),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert FIELDS <= r.keys()
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "loss", "grad_norm"))
        assert r["rollouts"] == 8 * 4 and r["staleness_max"] <= 1
    config = json.loads((run_dir / "config.json").read_text())
    assert config["learner"]["max_steps"] == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["before"]["versions"] == [0] and summary["after"]["versions"] == [3]
    assert summary["syncs"] >= 2 * 3  # each actor received version 0 and at least the later ones it used
    assert "held-out accuracy" in proc.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.tie_word_embeddings


def test_sigterm_stops_every_child(small, tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.Popen(cli(["train", *small, "learner.max_steps=100000", f"output_dir={out}"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        metrics = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(out.glob("*/metrics.jsonl"))
            if found and found[0].read_text().count("\n") >= 2:
                metrics = found[0]
                break
            time.sleep(1)
        assert metrics is not None, "training never started"
        kids = children_of(proc.pid)
        assert len(kids) >= 3  # learner + 2 actors (+ their verifier workers)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        assert proc.returncode != 0
        time.sleep(1)
        alive = [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2]]
        assert not alive, f"orphans left: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
