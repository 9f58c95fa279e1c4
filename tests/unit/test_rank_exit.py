"""A learner rank's end (`learner.ranks.end_rank_process`): its exit code, and nothing it wrote lost.

The function skips interpreter finalization (learner/ranks.py says why), so whatever Python would have
flushed at exit must be flushed first: block-buffered stdout (a pipe), stderr, and logging handlers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import logging, logging.handlers, sys
from learner.ranks import end_rank_process
held = logging.handlers.MemoryHandler(1000, target=logging.FileHandler(sys.argv[1]))  # writes on flush
logging.basicConfig(handlers=[held], level=logging.INFO)
logging.getLogger("x").info("logged before the end")
print("printed before the end")              # a pipe: block-buffered, not yet written
print("to stderr before the end", file=sys.stderr)
end_rank_process(7)
print("never")
"""


def test_end_rank_process_exits_with_its_code_and_flushes(tmp_path):
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    p = subprocess.run([sys.executable, "-c", CHILD, str(log)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 7
    assert p.stdout == "printed before the end\n"
    assert "to stderr before the end" in p.stderr
    assert "logged before the end" in log.read_text()
