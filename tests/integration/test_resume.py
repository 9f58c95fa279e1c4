"""Resume equality: a run killed after a checkpoint and resumed ends where an uninterrupted run ends.

CPU, eta=0 (`learner.max_staleness=0`), seeded sampling (`rollout.seeded=true`: every vLLM request is
seeded from the question and the policy version), one actor, ExGRPO on so the experience buffer fills,
and micro-batches computed as the groups arrive (`learner.overlap_arrival`, learner/overlap.py).
Run A trains 6 steps straight. Run B checkpoints every 3 steps, its learner is killed with SIGKILL once
the step-3 checkpoint exists, and `train --resume` finishes it. Every step's metrics, the final
experience buffer and the final weights must be the same.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.helpers import children_of, cli

pytestmark = pytest.mark.slow  # three real `train` runs: 3-6 min

STEPS = 6
COMPARED = ("reward_mean", "pass_at_1", "tokens_generated", "rollouts", "loss", "grad_norm", "staleness_max",
            "buffer_questions", "buffer_trajectories", "buffer_tokens", "retired_total", "buckets", "exgrpo_mixed",
            "experience_questions", "is_weight_mean")


def overrides(small: list[str], out: Path) -> list[str]:
    return [*small, f"output_dir={out}", f"learner.max_steps={STEPS}", "learner.checkpoint_every=3",
            "learner.max_staleness=0", "rollout.seeded=true", "actor.num_actors=1", "data.eval_file=none",
            "metrics.port=none", "exgrpo.enabled=true", "exgrpo.start_threshold=0.005",
            "learner.overlap_arrival=true"]


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

    from learner.buffer import ExperienceBuffer
    from learner.checkpoint import load_checkpoint

    ckpt = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    buf = ExperienceBuffer(K=4)
    load_checkpoint(ckpt, AutoModelForCausalLM.from_pretrained(ckpt / "model"), None, buf)
    return buf.state_dict()


def test_killed_and_resumed_run_equals_uninterrupted(small, tmp_path):
    a = subprocess.run(cli(["train", *overrides(small, tmp_path / "a")]), capture_output=True, text=True, timeout=600)
    assert a.returncode == 0, a.stderr[-3000:]
    (run_a,) = list((tmp_path / "a").iterdir())

    log = open(tmp_path / "b.log", "w")
    b = subprocess.Popen(cli(["train", *overrides(small, tmp_path / "b")]), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "b").glob("run-*/checkpoints/step-000003")):
            assert time.monotonic() < deadline and b.poll() is None, "run B never wrote its step-3 checkpoint"
            time.sleep(0.2)
        learners = [p for p in children_of(b.pid) if b"learner" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
        os.kill(learners[0], signal.SIGKILL)
        # train exits with its learner's status, killed by SIGKILL (-9: 247 as an exit status), not a crash of its own
        assert b.wait(timeout=120) == -signal.SIGKILL & 0xFF, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        if b.poll() is None:
            b.kill()
    (run_b,) = list((tmp_path / "b").iterdir())
    killed_at = len(rows(run_b))
    resumed = subprocess.run(cli(["train", "--resume", str(run_b)]), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    ra, rb = rows(run_a), rows(run_b)
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
