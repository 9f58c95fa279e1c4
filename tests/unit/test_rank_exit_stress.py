"""ops/bench/system/rank_exit_stress.py, the one rank-exit stress command, in its smallest run: a bare round (two real
learner ranks on gloo, two steps, the end through `end_rank_process`) must end with both ranks at exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two learner processes: about 12 s
@pytest.mark.timeout(240)
def test_one_bare_round_ends_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "ops/bench/system/rank_exit_stress.py"), "--rounds", "1",
                           "--endings", "bare", "--out", str(tmp_path), "--timeout", "180"],
                          capture_output=True, text=True, timeout=220, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (r,) = json.loads((tmp_path / "rank_exit.json").read_text())["rounds"]
    assert (r["ending"], r["rc"], r["abort"], r["rank_errors"]) == ("bare", 0, False, [])


def test_a_round_starts_in_an_empty_folder(tmp_path):
    """A run an earlier invocation left in a round's folder is not read as this round's steps (a "sigterm"
    round signalled train at once and read its exit as wrong)."""
    from tests.bench import load_bench

    stale = tmp_path / "round-002" / "run-old" / "metrics.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n{}\n{}\n")
    stress = load_bench("system/rank_exit_stress")
    assert stress.steps_done(tmp_path / "round-002") == 3
    folder = stress.fresh_round_folder(tmp_path, 2)
    assert folder == tmp_path / "round-002" and stress.steps_done(folder) == 0 and not any(folder.iterdir())
