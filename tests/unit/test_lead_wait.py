"""Follower learner ranks wait for the lead outside any collective (learner/ranks.py).

Two gloo ranks whose collectives time out after 4 s: the lead works for 8 s (an evaluation, say) before
each announcement and before the final barrier. The follower must get the announcement and end with
the lead, not die of the collective's timeout; and a lead that dies must end the follower's wait at once.
And when both get SIGTERM at once (as `train`, Slurm or torchrun send it), the follower must stay until
the lead has announced its stop, so that broadcast does not meet a closed connection.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes each, waiting out 8-16 s of the lead's work

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import os, sys, time
from learner.ranks import Ranks
rank, port, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
ranks = Ranks.from_env(2, "cpu", 4.0)  # every collective times out after 4 s
if ranks.lead:
    time.sleep(8.0)  # longer than a collective may take
    if how == "dies":
        os._exit(3)
    ranks.announce("update", {"step": 1})
    time.sleep(8.0)
    ranks.meet_at_end()
else:
    t0 = time.monotonic()
    op, payload = ranks.receive()
    print(f"got {op} {payload['step']} after {time.monotonic() - t0:.1f}", flush=True)
    ranks.meet_at_end()
print(f"ended {time.time()}", flush=True)
"""

SIGTERM_BOTH = """
import os, signal, sys, time
from learner.main import _end_together, _follower_sigterm
from learner.ranks import Ranks
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
ranks = Ranks.from_env(2, "cpu", 30.0)
if ranks.lead:
    def stop(*_):
        raise SystemExit(143)  # what exgrpo_async/launcher/cli.py installs
    signal.signal(signal.SIGTERM, stop)
    rc = 0
    try:
        print("ready", flush=True)
        time.sleep(60)
    except SystemExit as e:
        rc = e.code
    finally:
        ranks.announce("stop", {})  # what the learner's close does on every way out
    _end_together(ranks, rc)
else:
    signal.signal(signal.SIGTERM, lambda *_: _follower_sigterm(1))  # what learner/main.py installs
    print("ready", flush=True)
    op, _ = ranks.receive()
    print(f"got {op}", flush=True)
    _end_together(ranks, 0)
"""


SIGTERM_MID_OPERATION = """
import os, signal, sys, time
import torch, torch.distributed as dist
from learner.main import _end_together, _follower_sigterm
from learner.ranks import Ranks
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
ranks = Ranks.from_env(2, "cpu", 30.0)
t = torch.ones(4)
if ranks.lead:
    signal.signal(signal.SIGTERM, lambda *_: ranks.request_stop())  # what learner/main.py installs
    rc = 0
    try:
        with ranks.together("work", {}):
            print("ready", flush=True)
            time.sleep(3)  # SIGTERM comes now, between two collectives of the operation
            dist.all_reduce(t)
            print(f"reduced {t[0].item():.0f}", flush=True)
    except SystemExit as e:
        rc = e.code
    finally:
        ranks.announce("stop", {})
    _end_together(ranks, rc)
else:
    signal.signal(signal.SIGTERM, lambda *_: _follower_sigterm(1))
    print("ready", flush=True)
    assert ranks.receive()[0] == "work"
    dist.all_reduce(t)
    print(f"got {ranks.receive()[0]}", flush=True)
    _end_together(ranks, 0)
"""


def _start(script: str, *args: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, "-c", script, str(r), port, *args], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]


def _pair(how: str) -> tuple[list[subprocess.Popen], list[str]]:
    procs = _start(RANK, how)
    outs = [p.communicate(timeout=120) for p in procs]
    return procs, [o + e for o, e in outs]


def test_a_follower_waits_out_a_lead_busier_than_the_collective_timeout():
    procs, outs = _pair("works")
    assert [p.returncode for p in procs] == [0, 0], outs
    got = outs[1].split("got update 1 after ")[1].split()[0]
    assert float(got) >= 7.0, outs[1]  # it waited the lead's 8 s, past the 4-s timeout
    lead_end = float(outs[0].split("ended ")[1].split()[0])
    follower_end = float(outs[1].split("ended ")[1].split()[0])
    assert follower_end >= lead_end - 0.5, (lead_end, follower_end)  # the final barrier: it waited for the lead


def test_a_lead_that_dies_ends_the_followers_wait_at_once():
    t0 = time.monotonic()
    procs, outs = _pair("dies")
    assert procs[0].returncode == 3
    assert procs[1].returncode not in (0, None) and "got update" not in outs[1], outs[1]
    assert "DistNetworkError" in outs[1] or "Connection" in outs[1], outs[1][-2000:]
    assert time.monotonic() - t0 < 60  # not the 600-s poll


def _sigterm_both_when_ready(script: str) -> tuple[list[subprocess.Popen], list[str]]:
    """Start the pair, wait until both are in place, SIGTERM both at once (as `train` does); their outputs."""
    procs = _start(script)
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    return procs, [o + e for o, e in (p.communicate(timeout=120) for p in procs)]


def test_sigterm_to_both_ranks_stops_them_together():
    procs, outs = _sigterm_both_when_ready(SIGTERM_BOTH)  # the lead sleeping, the follower waiting
    assert [p.returncode for p in procs] == [143, 0], outs
    assert "got stop" in outs[1] and "Connection closed" not in outs[0], outs


def test_sigterm_during_an_operation_takes_effect_when_it_is_over():
    procs, outs = _sigterm_both_when_ready(SIGTERM_MID_OPERATION)
    assert [p.returncode for p in procs] == [143, 0], outs
    assert "reduced 2" in outs[0] and "got stop" in outs[1], outs  # the operation finished, then the stop
