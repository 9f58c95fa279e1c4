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
