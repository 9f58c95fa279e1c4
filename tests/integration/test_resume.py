"""Resume equality: a learner killed after a checkpoint and resumed, while its actor waits and rejoins,
ends where an uninterrupted run ends.

CPU, eta=0 (`learner.max_staleness=0`), seeded sampling (`rollout.seeded=true`: every vLLM request is
seeded from the question and the policy version), one actor, ExGRPO on so the experience buffer fills,
and micro-batches computed as the groups arrive (`learner.overlap_arrival`, learner/overlap.py).
Two runs at once, each a standalone `learner` and one `actor` started the same way (same threads, same
config): run A trains 6 steps straight; run B checkpoints every 3 steps, its learner is killed with
SIGKILL once the step-3 checkpoint exists, and `learner --resume` finishes it while the same actor
process, which lost its learner, rejoins it. Every step's metrics, the final experience buffer and the
final weights must be the same, and run B's books must balance. (`train --resume` itself is exercised
by the 2-rank fault drill in test_faults.py.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.helpers import cli, free_port, kill_tree, log_excerpt

pytestmark = pytest.mark.slow  # two runs at once, then a resume: about 2 minutes

STEPS = 6
COMPARED = ("reward_mean", "pass_at_1", "tokens_generated", "rollouts", "loss", "grad_norm", "staleness_max",
            "buffer_questions", "buffer_trajectories", "buffer_tokens", "retired_total", "buckets", "exgrpo_mixed",
            "experience_questions", "is_weight_mean")


def overrides(small: list[str], port: int) -> list[str]:
    return [*small, f"learner.max_steps={STEPS}", "learner.checkpoint_every=3", "learner.max_staleness=0",
            "rollout.seeded=true", "data.eval_file=none", "metrics.port=none", "exgrpo.enabled=true",
            "exgrpo.start_threshold=0.005", "learner.overlap_arrival=true", f"transport.port={port}",
            "transport.request_timeout_s=5", "transport.reconnect_s=120", "transport.heartbeat_s=0.5"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def final_buffer(run_dir: Path):
    from transformers import AutoModelForCausalLM

    from learner.checkpoint import load_checkpoint
    from learner.maths.buffer import ExperienceBuffer

    ckpt = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    buf = ExperienceBuffer(K=4)
    load_checkpoint(ckpt, AutoModelForCausalLM.from_pretrained(ckpt / "model"), None, buf)
    return buf.state_dict()


def start(args: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # both runs' actors alike
    return subprocess.Popen(cli(args), stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"exited (code {proc.returncode}) while waiting for {what}\n" + log_excerpt(log)
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n" + log_excerpt(log)
        time.sleep(0.2)


def test_killed_and_resumed_learner_with_a_rejoining_actor_equals_uninterrupted(small, tmp_path):
    runs = {}
    procs: list[subprocess.Popen] = []
    try:
        for name in ("a", "b"):  # both at once: the result must not depend on timing
            port, log = free_port(), tmp_path / f"{name}.log"
            learner = start(["learner", *overrides(small, port), "--run-dir", str(tmp_path / name)], open(log, "w"))
            actor = start(["actor", "--learner", f"tcp://127.0.0.1:{port}"], open(log, "a"))
            procs += [learner, actor]
            runs[name] = (learner, actor, log)
        (b_learner, b_actor, b_log), run_b = runs["b"], tmp_path / "b"
        wait_for(lambda: (run_b / "checkpoints" / "step-000003").exists(), 300, "run B's step-3 checkpoint",
                 b_learner, b_log)
        b_learner.kill()
        b_learner.wait()
        killed_at = len(rows(run_b))
        resumed = start(["learner", "--config", str(run_b / "config.json"), "--run-dir", str(run_b), "--resume"],
                        open(b_log, "a"))
        procs.append(resumed)
        for name, proc in (("a", runs["a"][0]), ("a", runs["a"][1]), ("b", resumed), ("b", b_actor)):
            assert proc.wait(timeout=400) == 0, log_excerpt(tmp_path / f"{name}.log")
    finally:
        for proc in procs:
            kill_tree(proc)
    text = b_log.read_text()
    assert "resumed from" in text and "rejoining" in text  # the actor outlived its learner and came back
    summary = json.loads((run_b / "summary.json").read_text())
    assert summary["actors_joined"] == 1  # the resumed learner saw the same actor join again
    assert summary["questions_unaccounted"] == 0 and summary["questions_trained"] == STEPS * 8, summary

    run_a = tmp_path / "a"
    ra, rb = rows(run_a), rows(run_b)
    assert 3 <= killed_at < STEPS + 1
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1)), f"killed after {killed_at} rows"
    assert any(r["buffer_trajectories"] for r in ra), "the buffer stayed empty: the comparison would prove little"
    for x, y in zip(ra, rb):
        diff = {k: (x.get(k), y.get(k)) for k in COMPARED if not same(x.get(k), y.get(k))}
        assert not diff, f"step {x['step']} differs: {diff}"
    assert same(final_buffer(run_a), final_buffer(run_b))
    from safetensors.torch import load_file

    wa, wb = load_file(run_a / "final" / "model.safetensors"), load_file(run_b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)
