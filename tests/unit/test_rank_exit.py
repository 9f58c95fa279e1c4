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


# ---------------------------------------------------------------------------------- every way a rank ends
def test_the_run_fails_when_any_rank_failed_whenever_it_ended(caplog):
    from exgrpo_async.launcher.processes import judge_ranks

    assert judge_ranks(0, [0, 0, 0]) == 0
    assert judge_ranks(143, [0]) == 143  # the lead's own failure stands
    with caplog.at_level("ERROR"):
        assert judge_ranks(0, [0, -9, 1]) == 1  # the lead finished, two followers did not
    assert "learner rank 2 exited with signal 9 (SIGKILL)" in caplog.text
    assert "learner rank 3 exited with code 1" in caplog.text


def test_every_way_a_rank_stops_becomes_its_exit_code(monkeypatch, caplog):
    import learner.main as m
    from learner.ranks import Ranks

    ranks = Ranks(1, 2)
    monkeypatch.setattr(m, "_resolve_precision", lambda cfg, r: cfg)
    for outcome, code in ((lambda: 0, 0), (lambda: (_ for _ in ()).throw(SystemExit(143)), 143),
                          (lambda: (_ for _ in ()).throw(RuntimeError("boom")), 1)):
        monkeypatch.setattr(m, "_run_rank", lambda *a, f=outcome: f())
        assert m._run_guarded(None, None, False, ranks) == code
    assert "learner rank 1 failed" in caplog.text and "boom" in caplog.text


FINAL_BARRIER = """
import os, sys, time
import torch.distributed as dist
from learner.main import _end_together
from learner.ranks import Ranks
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 0:
    time.sleep(2.0)  # the lead still writing its summary and report after "stop"
print(f"done {time.time()}", flush=True)
_end_together(Ranks(rank, 2), int(sys.argv[3]))
"""


def test_a_follower_does_not_end_before_the_lead_has_finished():
    """Two gloo ranks end through `_end_together`; the lead finishes 2 s after the follower reached its
    end. The follower's process must outlive the lead's work (the final barrier), and both exit 0."""
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = str(s.getsockname()[1])
    s.close()
    procs = [subprocess.Popen([sys.executable, "-c", FINAL_BARRIER, str(r), port, "0"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE) for r in (0, 1)]
    ended: dict[int, float] = {}
    deadline = time.time() + 120
    while len(ended) < 2 and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.02)
    outs = [p.communicate(timeout=10)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lead_done = float(outs[0].split()[1])
    assert ended[1] >= lead_done - 0.05  # the follower waited for the lead
