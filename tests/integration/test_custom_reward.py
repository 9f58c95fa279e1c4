"""`actor.verifier.function`: a bad spec stops `exgrpo-async train`, `learner` and `eval` before anything
starts. A real run taking its rewards from a function (tests/reward_fns.py:slow_on_some, the example
`exgrpo_async.rewards:exact_match` mapped to 0.25 / 0.75, values math-verify never gives, each call
logged with its row) is test_full_run.py's stream-actor run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.helpers import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec, message", [
    ("tests.reward_fns:nope", "actor.verifier.function = 'tests.reward_fns:nope': module 'tests.reward_fns'"),
    ("tests.reward_fns", "actor.verifier.function: Value error, 'tests.reward_fns' is not of the form"),
])
def test_a_bad_reward_function_stops_train_at_start(tmp_path, spec, message):
    out = tmp_path / "runs"
    proc = subprocess.run(cli(["train", f"actor.verifier.function={spec}", f"output_dir={out}"]), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing started: no run folder, no toy policy built


@pytest.mark.parametrize("cmd", [["learner"], ["eval", "--model", "m", "--data", "d.jsonl"]])
def test_a_bad_reward_function_stops_learner_and_eval_at_start(tmp_path, cmd):
    """The learner hands the function to its actors, and eval scores with it: both refuse a bad one at
    once, with the same message as train and no traceback."""
    proc = subprocess.run(cli([*cmd, "actor.verifier.function=tests.reward_fns:nope", f"output_dir={tmp_path}"]),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "actor.verifier.function = 'tests.reward_fns:nope': module 'tests.reward_fns'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # no run folder
