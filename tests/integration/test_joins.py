"""Joins never queue behind each other, and half-joined peers are bounded.

An actor joins in two steps (hello, then group once its engine is up), and the learner then meets the
actor's workers in a torch.distributed rendezvous. A peer that stops part-way (says hello and asks for
its group, then never joins it, as a vLLM engine that hangs or takes minutes on a GPU does) may cost
only its own `weight_sync.timeout_s`: other actors' rendezvous and broadcasts go on at once. And the
learner holds at most `transport.max_pending_joins` half-joined peers (their threads and pending
groups); a hello beyond that is answered "wait", counted (`joins_refused`), and the actor asks again.

The tests run the learner's server in-process over real sockets and a real gloo store; a real
`exgrpo-async train` with vLLM actors and a stalled peer that joined before them is part of the fuzzed
run (tests/integration/test_fuzz.py).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
import zmq

from actors.session import join, request, weight_group
from exgrpo_async.config import RunConfig
from exgrpo_async.weight_sync import WeightPublisher, WeightReceiver
from exgrpo_async.wire import decode_header, encode_control
from learner.dispatch import Dispatcher
from learner.server import JOIN_RETRY_S, LearnerServer


def _server(timeout_s: float, max_pending: int = 64, max_message_mb: int = 256, heartbeat_s: float = 2.0,
            actor_timeout_s: float = 60, join_timeout_s: float = 600) -> LearnerServer:
    cfg = RunConfig.model_validate({"weight_sync": {"timeout_s": timeout_s},
                                    "transport": {"max_pending_joins": max_pending, "max_message_mb": max_message_mb,
                                                  "heartbeat_s": heartbeat_s, "actor_timeout_s": actor_timeout_s,
                                                  "join_timeout_s": join_timeout_s}})
    publisher = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), 1, timeout_s)
    publisher.publish(0, [("w", torch.arange(1000, dtype=torch.float32))])
    dispatcher = Dispatcher(lambda: 0, 1, 2, 1.0, max_staleness=0)
    return LearnerServer(cfg, dispatcher, publisher, "gloo", {"train": ["1+1="], "eval": []},
                         {"train": [], "eval": []}, cfg.model_dump_json())


class Peer:
    """A hand-driven actor socket: says exactly what the test tells it to."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, kind: str, **fields) -> dict:
        self.sock.send_multipart(encode_control(kind, **fields))
        assert self.sock.poll(5000), f"no answer to {kind}"
        return decode_header(self.sock.recv_multipart()[0])

    def tell(self, kind: str, **fields) -> None:
        self.sock.send_multipart(encode_control(kind, **fields))

    def close(self) -> None:
        self.sock.close()


def _sync_threads(server: LearnerServer) -> int:
    return sum(1 for t in server._sync_threads if t.is_alive())


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stalled_rendezvous_delays_no_other_actors_join_or_sync():
    """A peer asks for its group and never joins it (the learner's side waits up to 60 s); three actors
    then join, each with its worker in its own thread: every group forms and every actor gets the weights
    within seconds, long before the stalled rendezvous times out."""
    server = _server(timeout_s=60)
    server.start()
    stuck = Peer(server.address)
    try:
        assert stuck.ask("hello", host="stuck", pid=1)["t"] == "welcome"
        assert stuck.ask("group", tp=1)["t"] == "group"  # ... and its worker never shows up
        time.sleep(0.5)  # the learner's side of its rendezvous is now waiting

        def actor(i: int, out: dict) -> None:
            t0 = time.monotonic()
            sock, _ = join(server.address, None, 10, 5)
            ws = weight_group(sock, 1, 5)
            rx = WeightReceiver(ws["host"], ws["port"], ws["prefix"], 1, ws["world_size"], ws["backend"],
                                torch.device("cpu"), ws["timeout_s"])
            out["formed"] = time.monotonic() - t0
            assert request(sock, encode_control("work", version=-1), 5)["t"] == "resync"
            sync = request(sock, encode_control("sync", version=-1), 5)
            got = [t.clone() for bucket in rx.receive(sync["meta"]) for _, t in bucket]
            out["synced"] = time.monotonic() - t0
            out["ok"] = torch.equal(got[0], torch.arange(1000, dtype=torch.float32))
            sock.send(encode_control("bye"))
            sock.close()
            rx.close()

        results = [{} for _ in range(3)]
        threads = [threading.Thread(target=actor, args=(i, results[i]), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r.get("ok") for r in results), results
        assert max(r["synced"] for r in results) < 10, results  # not the stalled peer's 60 s
        assert server.counters["sync_failures"] == 0 and server.counters["joins_refused"] == 0
    finally:
        stuck.close()
        server.stop(wait_for_actors_s=0)


def test_half_joined_peers_are_bounded_and_a_refused_actor_asks_again():
    """max_pending_joins=3: two peers stall in their rendezvous and one only said hello; a fourth hello
    is answered "wait" and counted. A peer that leaves while its rendezvous is pending still holds its
    slot (its thread waits out weight_sync.timeout_s); one that never asked for a group frees its slot
    at once. An actor refused by `join` keeps asking and gets in when a slot frees; a stalled rendezvous
    frees its slot when it times out. The same socket saying hello twice is one registration, not two."""
    server = _server(timeout_s=8, max_pending=3)
    server.start()
    peers = [Peer(server.address) for _ in range(5)]
    p1, p2, p3, p4, p5 = peers
    try:
        for p in (p1, p2, p3):
            assert p.ask("hello", host="h", pid=1)["t"] == "welcome"
        for p in (p1, p2):
            assert p.ask("group", tp=1)["t"] == "group"
        assert p3.ask("hello", host="h", pid=1)["t"] == "welcome"  # again: replaces its first registration
        assert server.connected == 3 and server.counters["hellos"] == 4
        refused = p4.ask("hello", host="h", pid=1)
        assert refused == {"v": 1, "t": "wait", "seconds": JOIN_RETRY_S}
        assert server.counters["joins_refused"] == 1 and server.connected == 3
        assert _sync_threads(server) == 2  # only the peers that asked for a group have a sync thread
        p3.tell("bye")  # it never asked for a group: its slot frees at once
        _wait_for(lambda: server.connected == 2)
        assert p4.ask("hello", host="h", pid=1)["t"] == "welcome"
        p1.tell("bye")  # gone, but its rendezvous still waits: its slot stays taken
        _wait_for(lambda: server.connected == 2)
        assert p5.ask("hello", host="h", pid=1)["t"] == "wait" and server.counters["joins_refused"] == 2
        assert _sync_threads(server) == 2
        # a real actor's join waits through the refusals and gets in once p4 (hello only) leaves
        got = {}
        joiner = threading.Thread(target=lambda: got.update(zip(("sock", "welcome"), join(server.address, None, 30, 5))),
                                  daemon=True)
        joiner.start()
        _wait_for(lambda: server.counters["joins_refused"] == 3)
        p4.tell("bye")
        joiner.join(JOIN_RETRY_S + 5)
        assert got.get("welcome", {}).get("t") == "welcome"
        got["sock"].send(encode_control("bye"))
        got["sock"].close()
        # the stalled rendezvous time out after 8 s: their slots and threads are free again
        _wait_for(lambda: _sync_threads(server) == 0, timeout=15)
        assert server.counters["sync_failures"] == 2
        assert p5.ask("hello", host="h", pid=1)["t"] == "welcome"
        assert len(server._joining) <= 3
    finally:
        for p in peers:
            p.close()
        server.stop(wait_for_actors_s=0)


def test_stop_waits_for_a_live_actors_goodbye_not_for_a_silent_ones():
    """At the end the learner tells its actors to stop and waits for their goodbyes; an actor not heard
    for 3 heartbeats (here 3 x 0.2 s, at least 2 s: killed or frozen) is not waited for, though it is not
    yet presumed dead (60 s), while one whose heartbeat thread still speaks is, until it says bye."""
    server = _server(timeout_s=5, heartbeat_s=0.2)
    server.start()
    silent, live, beat = Peer(server.address), Peer(server.address), Peer(server.address)
    beating = threading.Event()
    try:
        assert silent.ask("hello", host="dead", pid=1)["t"] == "welcome"
        live_id = live.ask("hello", host="live", pid=2)["actor_id"]
        beating.set()

        def heartbeat() -> None:
            while beating.is_set():
                beat.tell("alive", actor_id=live_id)
                time.sleep(0.1)

        threading.Thread(target=heartbeat, daemon=True).start()
        time.sleep(2.5)  # the silent one is now past 3 heartbeats (and 2 s); the live one is not
        stopper = threading.Thread(target=server.stop, kwargs={"wait_for_actors_s": 30}, daemon=True)
        stopper.start()
        time.sleep(1.5)
        assert stopper.is_alive(), "stop did not wait for the live actor's goodbye"
        beating.clear()
        time.sleep(0.2)
        t_bye = time.monotonic()
        live.tell("bye")
        stopper.join(timeout=10)
        assert not stopper.is_alive() and time.monotonic() - t_bye < 3, "stop waited for the silent actor"
        assert server.counters["actors_lost"] == 0  # not presumed dead: just not waited for
    finally:
        beating.clear()
        for p in (silent, live, beat):
            p.close()
        server.stop(wait_for_actors_s=0)


def test_an_actor_whose_engine_is_starting_has_the_join_timeout():
    """Silent after hello (its engine starting, its heartbeat starved: a low-priority actor on a busy CPU)
    an actor holds no work and is presumed dead only after transport.join_timeout_s; once it has asked
    for its weight-sync group, actor_timeout_s applies."""
    server = _server(timeout_s=3, heartbeat_s=0.2, actor_timeout_s=1, join_timeout_s=4)
    server.start()
    starting, joined = Peer(server.address), Peer(server.address)
    try:
        t0 = time.monotonic()
        assert starting.ask("hello", host="starting", pid=1)["t"] == "welcome"
        assert joined.ask("hello", host="joined", pid=2)["t"] == "welcome"
        assert joined.ask("group", tp=1)["t"] == "group"
        _wait_for(lambda: server.counters["actors_lost"] == 1, timeout=5)
        assert time.monotonic() - t0 < 3.5 and server.connected == 1  # the one with its group, after 1 s
        _wait_for(lambda: server.counters["actors_lost"] == 2, timeout=8)
        assert time.monotonic() - t0 >= 4 and server.connected == 0  # the starting one, after 4 s
    finally:
        for p in (starting, joined):
            p.close()
        server.stop(wait_for_actors_s=0)


def test_an_actor_still_starting_its_engine_at_the_end_is_told_to_stop_through_its_heartbeat(monkeypatch):
    """The run ends while an actor's engine starts (it said hello, has no group, holds no work; on a busy
    CPU an engine takes 10-30 s, on a GPU minutes): the learner answers its next heartbeat "stop", the
    start is cut short, the actor says bye and the learner's stop returns in about a heartbeat, not once the
    engine is up. An actor with its group gets no such answer (its next work request says stop)."""
    import actors.loop as actor_loop
    from actors.session import Heartbeat

    server = _server(timeout_s=5, heartbeat_s=0.2)
    server.start()
    sock, welcome = join(server.address, None, 10, 10)
    serving, serving_welcome = join(server.address, None, 10, 10)  # an actor with its engine up and its group
    ws = weight_group(serving, 1, 5)
    rx = WeightReceiver(ws["host"], ws["port"], ws["prefix"], 1, ws["world_size"], ws["backend"],
                        torch.device("cpu"), ws["timeout_s"])
    serving_beat = Peer(server.address)
    heartbeat = Heartbeat(server.address, None, welcome["actor_id"], 0.2)
    started: list[float] = []

    def slow_engine_start(*_):  # an engine that would take 15 s to start
        started.append(time.monotonic())
        while time.monotonic() - started[0] < 15:
            time.sleep(0.01)
        # what to look at if this recurs (it did once, in the AVX2-only suite of 2026-11-28's evening; not
        # reproduced alone or under load): was the stop heard, and could it interrupt this thread?
        raise AssertionError(f"the engine's start was not cut short: told {heartbeat.told_to_stop.is_set()}, "
                             f"SIGINT handler {signal.getsignal(signal.SIGINT)!r}, main thread "
                             f"{threading.current_thread() is threading.main_thread()}, server {dict(server.counters)}")

    monkeypatch.setattr(actor_loop, "start_batch_engine", slow_engine_start)
    stopper = threading.Thread(target=server.stop, kwargs={"wait_for_actors_s": 30}, daemon=True)
    try:
        threading.Timer(1.0, stopper.start).start()
        engine, verifier = actor_loop.start_engine_unless_told_to_stop(server.cfg, welcome["actor_id"], True, heartbeat)
        assert (engine, verifier) == (None, None) and heartbeat.told_to_stop.is_set()
        assert time.monotonic() - started[0] < 3  # the stop came at 1 s, its answer within a heartbeat
        serving_beat.tell("alive", actor_id=serving_welcome["actor_id"])
        assert not serving_beat.sock.poll(1000), "an actor with its group was answered through its heartbeat"
        heartbeat.stop()
        sock.send(encode_control("bye"))  # as actors/loop.py's run does next
        serving.send(encode_control("bye"))
        stopper.join(timeout=5)
        assert not stopper.is_alive() and server.connected == 0 and server.counters["actors_lost"] == 0
        # told before the start began: the engine is not started at all
        started.clear()
        late = Heartbeat(server.address, None, "late", 0.2)
        late.told_to_stop.set()
        try:
            assert actor_loop.start_engine_unless_told_to_stop(server.cfg, "late", True, late) == (None, None)
        finally:
            late.stop()
        assert not started
    finally:
        heartbeat.stop()
        for s in (sock, serving, serving_beat):
            s.close()
        rx.close()
        server.stop(wait_for_actors_s=0)


def test_a_ctrl_c_while_the_engine_starts_is_not_taken_for_the_learners_stop(monkeypatch):
    import actors.loop as actor_loop
    from actors.session import Heartbeat

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(actor_loop, "start_batch_engine", interrupted)
    server = _server(timeout_s=5, heartbeat_s=0.2)
    server.start()
    heartbeat = Heartbeat(server.address, None, "actor-x", 0.2)
    try:
        with pytest.raises(KeyboardInterrupt):
            actor_loop.start_engine_unless_told_to_stop(server.cfg, "actor-x", True, heartbeat)
        assert not heartbeat.told_to_stop.is_set()
    finally:
        heartbeat.stop()
        server.stop(wait_for_actors_s=0)


def test_the_stop_interrupts_an_engine_start_whatever_sigint_was_left_at(monkeypatch):
    """A library may leave SIGINT at SIG_DFL or SIG_IGN in the actor's process (a pytest worker had SIG_IGN, and
    the test above failed so), under which `_thread.interrupt_main` does nothing: the heartbeat's stop must still
    cut the start short, and the handler is put back after."""
    import actors.loop as actor_loop
    from actors.session import Heartbeat

    def slow_engine_start(*_):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            time.sleep(0.01)
        raise AssertionError("the engine's start was not cut short")

    monkeypatch.setattr(actor_loop, "start_batch_engine", slow_engine_start)
    server = _server(timeout_s=5, heartbeat_s=0.2)
    server.start()
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        for left in (signal.SIG_DFL, signal.SIG_IGN):
            signal.signal(signal.SIGINT, left)
            heartbeat = Heartbeat(server.address, None, f"actor-{left}", 0.2)
            try:
                threading.Timer(0.5, heartbeat._answer, args=([encode_control("stop")[0]], "x")).start()
                assert actor_loop.start_engine_unless_told_to_stop(server.cfg, "x", True, heartbeat) == (None, None)
            finally:
                heartbeat.stop()
            assert signal.getsignal(signal.SIGINT) == left
    finally:
        signal.signal(signal.SIGINT, previous)
        server.stop(wait_for_actors_s=0)
