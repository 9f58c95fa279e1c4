"""Faults during real runs: nothing is lost, nothing stalls, nothing is counted twice.

Every run here is the real `exgrpo-async` (learner + vLLM actor processes) on the toy task; the drill
runs two learner ranks (FSDP2 over gloo: the lead rank serves the actors, so the faults meet the 2-rank
shutdown), the same fault handling at one rank is the soak's (tests/integration/test_soak.py).
After each run the learner's question books must balance (`questions_unaccounted == 0`: every training
question handed out was trained on, re-issued, or is still in flight), every step must be there exactly
once, and the fault must show in the counters that watch it.
- one run with ExGRPO on and checkpoints, ended by RUN_DIR/STOP once its faults are over, then resumed
  on one rank: an actor that joins while training runs (elastic membership), junk on the learner's
  socket, a NaN loss, an actor frozen with SIGSTOP for less than `transport.actor_timeout_s` (the
  groups it held arrive too stale, are dropped and their questions re-issued) and then past it
  (presumed dead, its work re-issued; after SIGCONT it is told to rejoin, and does), and an actor
  killed with SIGKILL mid-run (presumed dead, its work re-issued; the launcher starts a replacement);
- actors that keep dying: once `actor.max_restarts` is used up the launcher stops the run, exit 1.
The learner killed with SIGKILL and restarted with --resume while its actor rejoins is test_resume.py's
run B, which must also end where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from exgrpo_async.wire import encode_control
from tests.bench import load_bench
from tests.integration.helpers import actor_pids, children_of, cli, kill_tree, log_excerpt

pytestmark = pytest.mark.slow  # real `train` runs with faults: 2-5 min each

FAST_FAILURE = ["transport.actor_timeout_s=10", "transport.heartbeat_s=0.5", "data.eval_file=none", "metrics.port=none"]


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited (code {proc.returncode}) while waiting for {what}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def rows_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False


def check_books(run_dir: Path, steps: int) -> dict:
    assert [r["step"] for r in rows_of(run_dir)] == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["questions_unaccounted"] == 0, summary
    assert summary["questions_trained"] == steps * 8
    return summary


def monitored(address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to `address` (the TCP connection made), and its monitor socket."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 1000)
    mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    s.connect(address)
    assert next_event(mon, 30) == zmq.EVENT_CONNECTED
    return s, mon


def next_event(mon: zmq.Socket, timeout_s: float) -> int | None:
    return recv_monitor_message(mon)["event"] if mon.poll(timeout_s * 1000) else None


def send_junk(address: str, log: Path, proc: subprocess.Popen) -> int:
    """Malformed, truncated, wrong-schema, unknown and half-cap-sized messages from a peer that never said
    hello, each read and counted as bad; then a message above transport.max_message_mb=1 from another
    peer, which ZeroMQ refuses unread: it drops that peer's connection (and only that one: the first
    peer stays connected, so the learner did not just exit) and nothing more is counted.
    Returns how many the learner counted (waiting until its log says so)."""
    s, mon = monitored(address)
    junk = [b"\xc1 not msgpack",
            encode_control("work", version=0)[0][:3],  # truncated header
            msgpack.packb({"v": 99, "t": "hello", "host": "x", "pid": 1}),  # a future schema version
            encode_control("rollouts", work_id=1)[0],  # rollouts without their frames, and no hello
            encode_control("bogus")[0],  # unknown type
            b"\xc1" * (1 << 19)]  # half the size cap: read (and not msgpack)
    for frame in junk:
        s.send(frame)
    wait_for(lambda: f"; {len(junk)} so far" in log.read_text(), 60, "the learner to count the junk", proc)
    big, big_mon = monitored(address)
    big.send(b"\0" * (2 << 20))  # twice the cap
    assert next_event(big_mon, 20) == zmq.EVENT_DISCONNECTED, "a message above the cap did not cost its connection"
    assert next_event(mon, 0.2) is None and proc.poll() is None, "the learner dropped every peer, not the oversized one"
    assert f"; {len(junk) + 1} so far" not in log.read_text(), "the message above the cap was read"
    s.close()
    big.close()
    return len(junk)


def test_two_rank_drill_join_junk_freeze_kill9_nan_then_resume_on_one(small, tmp_path):
    """One 2-rank run (ExGRPO on, checkpoints) meets every fault in turn: an actor joins while training
    runs, junk reaches the learner's socket, a NaN loss at step 3, one launcher actor frozen shorter
    than the timeout (its groups too stale: dropped, their questions re-issued) and then past it
    (presumed dead; woken, it is told to rejoin, and does), then the other killed with SIGKILL mid-run
    (its work re-issued, the launcher restarts it). Once the replacement and the woken actor have
    joined, RUN_DIR/STOP ends the run after its step; its last checkpoint then resumes on one rank."""
    out, cap = tmp_path / "runs", 300
    log_path = tmp_path / "train.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cli(["train", *small, *FAST_FAILURE, "learner.max_steps=100000", f"learner.max_seconds={cap}",
                                 "actor.num_actors=2", "learner.max_staleness=1", "learner.world_size=2",
                                 "exgrpo.enabled=true", "exgrpo.delayed_start=false", "learner.checkpoint_every=7",
                                 "learner.fault_nan_loss_at_steps=[3]", "transport.max_message_mb=1",
                                 f"output_dir={out}"]),
                            stdout=log, stderr=subprocess.STDOUT)
    extra = None
    try:
        run_dir = wait_for(lambda: next(iter(out.glob("run-*")), None), 300, "the run folder", proc)
        wait_for(lambda: len(rows_of(run_dir)) >= 1, 300, "the first step", proc)
        address = json.loads((run_dir / "learner.json").read_text())["address"]
        # an actor joins while training runs: it gets the current weights and its work counts
        extra = subprocess.Popen(cli(["actor", "--learner", address]), stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: any(r["actors"] == 3 for r in rows_of(run_dir)), 180, "the third actor to join", proc)
        frozen, killed = actor_pids(proc.pid)  # the launcher's two (the elastic one is not its child)
        # both serving (their weight-sync groups formed) before a fault: at the AVX2-only pace the elastic
        # actor joined before one of them, which was frozen while its engine still started, where
        # transport.join_timeout_s (600 s), not actor_timeout_s, decides (2026-11-29)
        serving = load_bench("system/soak").serving_pids
        wait_for(lambda: {frozen, killed} <= serving(log_path), 180, "both launcher actors to serve", proc)
        n_junk = send_junk(address, log_path, proc)
        drops = short_freezes_until_a_stale_drop(frozen, log_path, proc)
        assert ": presumed dead," not in log_path.read_text()
        os.kill(frozen, signal.SIGSTOP)
        wait_for(lambda: ": presumed dead," in log_path.read_text(), 60, "the learner to give up on the frozen actor", proc)
        os.kill(frozen, signal.SIGCONT)
        killed_children = children_of(killed)
        os.kill(killed, signal.SIGKILL)  # mid-step: it holds work
        # the woken actor rejoined, and the launcher's replacement for the killed one joined
        wait_for(lambda: log_path.read_text().count(" joined from ") == 5, 180, "the rejoin and the replacement", proc)
        # and the learner gave up on the killed one (its work re-issued): a stop now does not wait for the
        # replacement's engine to start (told to stop through its heartbeat), so it could come first
        wait_for(lambda: log_path.read_text().count(": presumed dead,") == 2, 60, "the learner to give up on the killed actor",
                 proc)
        (run_dir / "STOP").touch()
        proc.wait(timeout=300)
        assert proc.returncode == 0, log_excerpt(log_path)
    finally:
        for p in (proc, extra):
            if p is not None:
                kill_tree(p)
    text = log_path.read_text()
    steps = len(rows_of(run_dir))
    assert f"step {steps}: {run_dir / 'STOP'} found" in text and not (run_dir / "STOP").exists()
    summary = check_books(run_dir, steps)  # every dropped or re-issued question was trained
    # joined: the launcher's two, the elastic one, the frozen one again, the replacement for the killed one
    assert summary["actors_joined"] == 5 and summary["actors_lost"] == 2  # the long freeze, the kill
    assert summary["rejoin_requests"] == 1  # the woken actor's one pending request was told to rejoin
    assert "restarting it" in text
    assert summary["skipped_steps"] == 1  # the NaN step's update was skipped and counted
    # the junk exactly (the oversized message was never read), and the woken actor's late groups, sent
    # before it heard it was presumed dead: dropped unread, at most its one request's (4 questions)
    assert n_junk <= summary["bad_messages"] <= n_junk + 4
    # every drop the learner logged, and only those, is in its books (the short freeze's among them)
    logged = sum(int(x.split("dropped ")[1].split()[0]) for x in text.splitlines() if "staler than eta=1" in x)
    assert summary["stale_dropped"] == logged >= drops >= 1
    rows = rows_of(run_dir)
    assert [r["skipped_steps_total"] for r in rows][2:4] == [1, 1]
    assert extra.wait(timeout=60) == 0  # the elastic actor was told to stop at the end
    time.sleep(1)
    assert not [k for k in killed_children if alive(k)], "the killed actor's verifier workers outlived it"
    # the two ranks trained: every finite-loss step moved the weights unless its every group was uniform
    # (all right or all wrong: a zero gradient); ExGRPO's selection pass ran on both
    trained = [r for r in rows if r["step"] != 3]
    assert all(math.isfinite(r["loss"]) for r in trained) and not math.isfinite(rows[2]["loss"])
    assert all(r["grad_norm"] > 0 or r["forward_seconds"] == 0 for r in trained)
    assert any(r.get("selected_entropy_mean") is not None for r in rows)
    # the 2-rank run's last checkpoint (the stop's) resumes on one rank, and its books still balance
    # (no step and no actor: the steps after a resume into another world size are test_learner_ranks.py's,
    # a resumed run's actor is test_resume.py's)
    resumed = subprocess.run(cli(["train", "--resume", str(run_dir), "learner.world_size=1", "learner.max_seconds=none",
                                  f"learner.max_steps={steps}", "actor.num_actors=0"]),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(rf"resumed from \S*step-{steps:06d}: step {steps},", resumed.stderr), resumed.stderr[-3000:]
    check_books(run_dir, steps)


def test_launcher_gives_up_once_actor_restarts_are_used_up(small, tmp_path):
    """`actor.max_restarts=1`: the launcher replaces the first actor that dies (SIGKILL); when the
    replacement dies too, no actor is left to restart, so it stops the learner and `train` exits 1 (not
    the 143 of the learner it stopped), saying why, with no process left behind. Each actor is killed as
    soon as it is there, before it trains: the launcher's rule does not ask when an actor died, and a
    replacement that joins mid-run and trains is the drill's (its SIGKILL comes mid-step)."""
    out = tmp_path / "runs"
    log_path = tmp_path / "train.log"
    proc = subprocess.Popen(cli(["train", *small, *FAST_FAILURE, "learner.max_steps=100000", "actor.num_actors=1",
                                 "actor.max_restarts=1", f"output_dir={out}"]),
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        first = wait_for(lambda: actor_pids(proc.pid), 120, "the first actor", proc)
        os.kill(first[0], signal.SIGKILL)
        # replaced once the learner listens (the launcher watches its actors from then on)
        second = wait_for(lambda: [p for p in actor_pids(proc.pid) if p not in first], 300, "the replacement", proc)
        assert "restarting it (1/1)" in log_path.read_text()
        descendants = children_of(proc.pid)
        assert any(p not in second for p in descendants)  # the learner
        os.kill(second[0], signal.SIGKILL)
        assert proc.wait(timeout=120) == 1, log_excerpt(log_path)
    finally:
        kill_tree(proc)
    text = log_path.read_text()
    assert "every actor exited with an error, restarts used up (actor.max_restarts=1)" in text
    assert "restarting it (2/" not in text
    time.sleep(1)
    assert not [p for p in descendants if alive(p)], "processes outlived the run"


def short_freezes_until_a_stale_drop(pid: int, log_path: Path, proc: subprocess.Popen, tries: int = 4) -> int:
    """Freeze the actor for 6 s, shorter than `transport.actor_timeout_s`: it is not presumed dead, and the
    groups it held arrive after the other actor has fed the learner more than eta=1 versions on, so they
    are dropped as too stale and their questions re-issued. Again if the actor held no work when frozen
    (between requests, or loading weights). Returns the groups the learner said it dropped."""
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            lines = [x for x in log_path.read_text().splitlines() if "staler than eta=1" in x]
            if lines:
                return sum(int(x.split("dropped ")[1].split()[0]) for x in lines)
            time.sleep(0.5)
    raise AssertionError(f"no group was dropped as too stale after {tries} short freezes\n" + log_excerpt(log_path))
