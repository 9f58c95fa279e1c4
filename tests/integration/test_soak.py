"""The soak bench's CI version: 36 s of training from step 1 with an actor killed, one frozen (past the
timeout: presumed dead, then rejoins), one added and removed, an event every 7 s from step 1 (events at
7, 14, 21 and 28 s however long the start took; ops/bench/system/soak.py). The 60-minute figures are in
docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_churn_keeps_the_books(small, tmp_path):
    out = tmp_path / "soak"
    # held-out evaluation off, as the bench has it: `small` names the held-out set (70 s of evaluating at the
    # AVX2-only pace, 2026-11-28), and an override given later wins
    proc = subprocess.run([sys.executable, "ops/bench/system/soak.py", "--minutes", "0.6", "--every", "7", "--sample", "2", "--warmup", "0.3",
                           "--out", str(out), *small, "metrics.port=none", "data.eval_file=none"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "soak.json").read_text())
    assert res["returncode"] == 0
    (run,) = (out / "runs").glob("run-*")
    assert not (run / "STOP").exists()  # sent once, and consumed by the learner
    assert [e["event"] for e in res["event_log"]] == ["kill", "freeze", "add", "remove"], res["event_log"]
    assert res["restarts"] == res["events"]["kill"]  # the launcher restarted each killed actor
    # each killed actor, and the frozen one (15 s against transport.actor_timeout_s=10), presumed dead
    # (the learner gives up on it 10-11 s later: an event in the run's last 12 s may not be counted yet)
    faults = [e for e in res["event_log"] if e["event"] in ("kill", "freeze")]
    settled = [e for e in faults if e["t"] + 12 <= res["samples"][-1]["t"]]
    # beyond those, an actor is presumed dead only if it came back: a replacement starved of CPU (actor.nice=10
    # beside a busy machine) may go silent past the timeout once it has its group (while its engine starts,
    # transport.join_timeout_s applies), then rejoins (2026-11-28: 3 lost against 2 faults, 6 joined against 5)
    came_back = res["actors_joined"] - (2 + res["events"]["kill"] + res["events"]["add"] + res["events"]["freeze"])
    assert len(settled) >= 2 and len(settled) <= res["actors_lost"] <= len(faults) + max(0, came_back), (
        res["event_log"], res["actors_lost"], res["actors_joined"])
    # a frozen actor presumed dead sends its late rollouts when it wakes: dropped and counted as bad
    # messages (not joined), at most one request's groups per freeze (4 questions per request here)
    assert res["questions_unaccounted"] == 0 and res["bad_messages"] <= 4 * res["events"]["freeze"]
    # the launcher's two, each settled kill's replacement, the added one (it joins within seconds)
    assert res["actors_joined"] >= 2 + sum(e["event"] == "kill" for e in settled) + res["events"]["add"]
    last_event = max(e["t"] for e in res["event_log"])
    after = [s["steps"] for s in res["samples"] if s["t"] > last_event]
    assert after and after[-1] > after[0], "training stopped after the last event"
    # memory is measured here, not judged: 60 s is too short for a slope (the 60-minute soak's, under
    # 1 MB/min, is in docs/benchmarks.md); the samples must exist, for the learner and for vLLM actors
    assert res["learner_rss_mb_first_last"][0] and res["actor_rss_mb_min_max"][1] > 100
