"""`actor.verifier.function` end to end: a bad spec stops `exgrpo-async train` before anything starts,
and a short real run takes its rewards from the function (tests/reward_fns.py:graded_exact_match, the
example `exgrpo_async.rewards:exact_match` mapped to 0.25 / 0.75, values math-verify never gives, each
call logged with its row)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from exgrpo_async.toy import TEST_KINDS, make_test_set
from tests.integration.helpers import cli
from tests.reward_fns import PROBE_LOG_ENV

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


@pytest.mark.slow
def test_train_takes_its_rewards_from_the_custom_function(small, tmp_path):
    out, probe = tmp_path / "runs", tmp_path / "rewards.jsonl"
    # a small held-out file whose rows name their data_source (the toy question kind)
    held_out = [dict(row, data_source=row["kind"]) for row in make_test_set(seed=1, per_kind=3)]
    eval_file = tmp_path / "held_out.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in held_out))
    try:
        proc = subprocess.run(cli(["train", *small, "learner.max_steps=3", "actor.verifier.function=tests."
                                   "reward_fns:graded_exact_match", f"data.eval_file={eval_file}", "metrics.port=none",
                                   f"output_dir={out}"]),
                              cwd=REPO, env=dict(os.environ, **{PROBE_LOG_ENV: str(probe)}), capture_output=True,
                              text=True, timeout=900)
    except subprocess.TimeoutExpired as e:  # show where it stood
        pytest.fail(f"train did not finish in {e.timeout:.0f} s:\n{str(e.stderr)[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    assert all(0.25 <= s["reward_mean"] <= 0.75 and s["verify_errors_total"] == 0 for s in steps), steps
    summary = json.loads((run_dir / "summary.json").read_text())

    calls = [json.loads(line) for line in probe.read_text().splitlines()]
    assert {c["reward"] for c in calls} <= {0.25, 0.75}
    for c in calls:
        row = c["row"]
        assert set(row) == {"question_id", "data_source", "answer", "prompt", "purpose"}, row
        assert isinstance(row["question_id"], int) and row["purpose"] in ("train", "eval")
        assert all(isinstance(row[k], str) and row[k] for k in ("data_source", "answer", "prompt")), row
    train = [c for c in calls if c["row"]["purpose"] == "train"]
    evals = [c for c in calls if c["row"]["purpose"] == "eval"]
    assert len(train) >= sum(s["rollouts"] for s in steps)
    assert {c["row"]["data_source"] for c in evals} == set(TEST_KINDS) == set(summary["after"]["by_source"])
    assert {c["row"]["answer"] for c in evals} == {row["answer"] for row in held_out}
    # Before and after training the learner scored the N held-out questions sampled (1 sample) and greedy:
    # its accuracies are exactly the means of the function's first and last 2N eval rewards.
    n = len(held_out)
    assert len(evals) == 4 * n
    for ev, part in ((summary["before"], evals[:2 * n]), (summary["after"], evals[2 * n:])):
        assert sum(c["reward"] for c in part) == pytest.approx(n * (ev["accuracy"] + ev["greedy_accuracy"]))
