"""An actor facing a hostile or broken "learner": a ZeroMQ ROUTER in the test that answers hello and
the later requests with junk (not msgpack, truncated, another schema version, unknown or unexpected
types, fields of the wrong type, huge sizes, absurd waits) or not at all.

The actor must never hang silently: it stops with a clear error (`ProtocolError` naming what was
wrong), or keeps saying hello (each attempt logged) until its patience runs out, or rejoins; every case
is bounded in time. The first tests drive `join` and `request` in-process; the slow one runs real
`exgrpo-async actor` processes, one of them with a vLLM engine through the later requests.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from collections import Counter

import msgpack
import pytest
import zmq

from actors.session import LearnerLost, ProtocolError, check_reply, join, request, weight_group
from exgrpo_async.config import RunConfig
from exgrpo_async.wire import decode_header, encode_control
from tests.integration.helpers import cli

WELCOME = {"actor_id": "actor-1", "config": RunConfig().model_dump_json()}


class Hostile:
    """A ROUTER answering each request with `answer(kind, n)` (frames, or None: silence), where `n` counts
    the requests of that kind so far. Heartbeats and goodbyes get nothing. Counts what it received."""

    def __init__(self, answer):
        self.answer, self.seen = answer, Counter()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, *frames = self.sock.recv_multipart()
            kind = decode_header(frames[0])["t"]
            self.seen[kind] += 1
            if kind in ("alive", "bye", "rollouts"):
                continue
            reply = self.answer(kind, self.seen[kind])
            if reply is not None:
                self.sock.send_multipart([peer, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _ctl(t: str, **fields) -> list[bytes]:
    return encode_control(t, **fields)


JUNK = {  # answer to hello -> what the actor's error must say
    "not msgpack": ([b"\xc1 junk"], "malformed message (header is not msgpack"),
    "truncated": ([_ctl("welcome", **WELCOME)[0][:20]], "malformed message"),
    "schema": ([msgpack.packb({"v": 99, "t": "welcome", **WELCOME})], "schema version 99"),
    "unknown type": (_ctl("bogus"), "answered with 'bogus'"),
    "rejoin": (_ctl("rejoin"), "answered with 'rejoin'"),
    "wrong types": (_ctl("welcome", actor_id=5, config=[1]), "actor_id is int"),
    "bad actor id": (_ctl("welcome", actor_id="../../x", config=WELCOME["config"]), "actor id"),
    "bad config": (_ctl("welcome", actor_id="actor-1", config="{not json"), "config:"),
    "huge header": ([b"\x00" * (4 << 20)], "exceeds"),
    "endless wait": (_ctl("wait", seconds=1e9), "wait of"),
    "nan wait": (_ctl("wait", seconds=float("nan")), "seconds is nan"),
}


@pytest.mark.parametrize("case", list(JUNK))
def test_join_stops_with_a_clear_error_on_a_junk_welcome(case):
    answer, says = JUNK[case]
    learner = Hostile(lambda kind, n: answer)
    try:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=re.escape(says)):
            join(learner.address, None, 20, 5)
        assert time.monotonic() - t0 < 5 and learner.seen["hello"] == 1
    finally:
        learner.close()


def test_join_says_hello_again_to_a_silent_learner_then_gives_up(caplog):
    learner = Hostile(lambda kind, n: None)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="exgrpo_async.actor"):
            with pytest.raises(LearnerLost, match="no learner answered"):
                join(learner.address, None, 4, 30, retry_s=1.0)
        assert time.monotonic() - t0 < 8
        assert 3 <= learner.seen["hello"] <= 5  # a fresh hello every attempt of 1 s, for 4 s
        assert sum("saying hello again" in r.getMessage() for r in caplog.records) >= 2
    finally:
        learner.close()


def test_a_reply_over_the_actors_size_cap_is_refused_unread(monkeypatch):
    """A 2 MB answer to an actor whose cap is 1 MB never reaches it: silence, so hello again, then give up."""
    monkeypatch.setattr("exgrpo_async.transport.MAX_REPLY_BYTES", 1 << 20)
    learner = Hostile(lambda kind, n: [msgpack.packb({"v": 1, "t": "welcome", **WELCOME, "pad": "x" * (2 << 20)})])
    try:
        with pytest.raises(LearnerLost):
            join(learner.address, None, 3, 30, retry_s=1.0)
        assert learner.seen["hello"] >= 2
    finally:
        learner.close()


def test_join_waits_as_told_then_gets_in_or_gives_up(caplog):
    """"wait" (too many actors joining) makes the actor ask again after the given seconds, logged once per
    30 s; it gets in when welcomed, and gives up with LearnerLost when its patience runs out."""
    learner = Hostile(lambda kind, n: _ctl("wait", seconds=0.1) if n < 5 else _ctl("welcome", **WELCOME))
    try:
        with caplog.at_level(logging.WARNING, logger="exgrpo_async.actor"):
            sock, welcome = join(learner.address, None, 20, 5)
        sock.close()
        assert welcome["actor_id"] == "actor-1" and learner.seen["hello"] == 5
        assert sum("too many actors joining" in r.getMessage() for r in caplog.records) == 1
    finally:
        learner.close()
    learner = Hostile(lambda kind, n: _ctl("wait", seconds=0.5))
    try:
        with pytest.raises(LearnerLost, match="kept refusing"):
            join(learner.address, None, 3, 5)
    finally:
        learner.close()


LATER = {  # an answer to group / work / sync -> what the error says
    "group, wrong types": ("group", _ctl("group", host=1, port="x", prefix="p", world_size=2, backend="gloo",
                                         timeout_s=5), "host is int"),
    "group, wrong size": ("group", _ctl("group", host="h", port=1, prefix="p", world_size=9, backend="gloo",
                                        timeout_s=5), "world size 9"),
    "group, bad backend": ("group", _ctl("group", host="h", port=1, prefix="p", world_size=2, backend="mpi",
                                         timeout_s=5), "out of range"),
    "work, junk items": ("work", _ctl("work", items=[{"work_id": "1"}], version=0, max_tokens=8), "work_id is str"),
    "work, item not a map": ("work", _ctl("work", items=[7], version=0, max_tokens=8), "not a map"),
    "work, bad n": ("work", _ctl("work", items=[{"work_id": 1, "question_id": 0, "prompt": "p", "answer": "a",
                                                  "n": 0, "temperature": 1.0, "purpose": "train"}],
                                 version=0, max_tokens=8), "n, purpose, replay ids or seed"),
    "work, no version": ("work", _ctl("work", items=[], max_tokens=8), "version is NoneType"),
    "sync, no meta": ("sync", _ctl("sync", version=1), "meta is NoneType"),
    "welcome out of turn": ("work", _ctl("welcome", **WELCOME), "answered with 'welcome'"),
    "junk": ("work", [msgpack.packb([1, 2])], "malformed message (header is not a map)"),
}


@pytest.mark.parametrize("case", list(LATER))
def test_later_requests_stop_with_a_clear_error_on_junk(case):
    kind, answer, says = LATER[case]
    learner = Hostile(lambda k, n: _ctl("welcome", **WELCOME) if k == "hello" else answer)
    try:
        sock, _ = join(learner.address, None, 10, 5)
        with pytest.raises(ProtocolError, match=re.escape(says)):
            if kind == "group":
                weight_group(sock, 1, 5)
            else:
                request(sock, encode_control(kind, version=0), 5)
        sock.close()
    finally:
        learner.close()


def test_every_reply_the_learner_sends_passes_the_checks():
    address = "tcp://x:1"
    item = {"work_id": 1, "question_id": 0, "prompt": "p", "answer": "a", "n": 4, "temperature": 1.0,
            "purpose": "train", "seed": None, "data_source": "toy", "replay_ids": b"\x01\x00\x00\x00"}
    for reply in (dict(t="welcome", **WELCOME), dict(t="work", items=[item], version=3, max_tokens=64),
                  dict(t="wait", seconds=0.05), dict(t="wait", seconds=5.0), dict(t="stop"), dict(t="resync", version=2),
                  dict(t="sync", version=2, meta=[[["w", "float32", [4]]]]),
                  dict(t="group", host="127.0.0.1", port=29500, prefix="ws/1-ab/", world_size=2, backend="gloo",
                       timeout_s=300.0)):
        assert check_reply(reply, tuple({reply["t"]}), address) is reply


def _actor(address: str, log_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(cli(["actor", "--learner", address, *args]), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_actor_processes_facing_a_hostile_learner(tmp_path, tiny_tied):
    """Real `exgrpo-async actor` processes, all at once, each bounded in time:
    - junk answers to hello: the process exits non-zero with the ProtocolError's message;
    - "wait" over and over: it keeps asking (each ask reaches the learner) and says so in its log;
    - silence: it says hello again, logging each attempt;
    - with a real vLLM engine (a valid welcome for the tiny policy, request_timeout_s=3): its group
      request meets silence, then "rejoin", then junk. It rejoins twice (keeping its engine: logged) and
      then exits non-zero with a clear error."""
    procs, learners = {}, {}
    cases = {k: JUNK[k] for k in ("not msgpack", "schema", "wrong types", "bad config", "huge header", "endless wait")}
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "1+1=", "answer": "2"}\n')
    cfg = RunConfig.model_validate({"model": {"path": str(tiny_tied), "max_model_len": 256},
                                    "data": {"eval_file": None, "train_files": [str(train)]},
                                    "transport": {"request_timeout_s": 3, "reconnect_s": 120, "heartbeat_s": 0.5},
                                    "metrics": {"actor_port": None}})
    welcome = _ctl("welcome", actor_id="actor-1", config=cfg.model_dump_json())
    chain = {1: None, 2: _ctl("rejoin"), 3: [b"\xc1 junk"]}  # the nth group request's answer
    try:
        for name, (answer, _) in cases.items():
            learners[name] = Hostile(lambda kind, n, a=answer: a)
        learners["wait"] = Hostile(lambda kind, n: _ctl("wait", seconds=0.2))
        learners["silent"] = Hostile(lambda kind, n: None)
        learners["chain"] = Hostile(lambda kind, n: welcome if kind == "hello" else chain.get(n) if kind == "group"
                                    else [b"\xc1"])
        for name, learner in learners.items():
            retry = ["--hello-retry-s", "2"] if name == "silent" else []  # the default is 30 s
            procs[name] = _actor(learner.address, tmp_path / f"{name}.log", *retry)
        deadline = time.monotonic() + 120
        for name in cases:
            procs[name].wait(timeout=max(1, deadline - time.monotonic()))
        for name, (_, says) in cases.items():
            text = (tmp_path / f"{name}.log").read_text()
            assert procs[name].returncode not in (0, None), text[-2000:]
            assert "ProtocolError" in text and says in text, text[-2000:]
        wait_until = time.monotonic() + 60
        while learners["wait"].seen["hello"] < 10 and time.monotonic() < wait_until:
            time.sleep(0.5)
        assert procs["wait"].poll() is None and learners["wait"].seen["hello"] >= 10
        assert "too many actors joining" in (tmp_path / "wait.log").read_text()
        wait_until = time.monotonic() + 30  # hello attempts of 2 s: two retries
        while learners["silent"].seen["hello"] < 3 and time.monotonic() < wait_until:
            time.sleep(1)
        assert procs["silent"].poll() is None and learners["silent"].seen["hello"] >= 3
        assert (tmp_path / "silent.log").read_text().count("saying hello again") >= 2
        assert "within 2s; saying hello again" in (tmp_path / "silent.log").read_text()
        procs["chain"].wait(timeout=400)  # a vLLM start under load, three short timeouts
        text = (tmp_path / "chain.log").read_text()
        assert procs["chain"].returncode not in (0, None), text[-3000:]
        assert learners["chain"].seen["hello"] == 3 and learners["chain"].seen["group"] == 3, learners["chain"].seen
        assert text.count("rejoining for up to") == 2, text[-3000:]
        assert "ProtocolError" in text and "malformed message" in text, text[-3000:]
        assert text.count("starting vLLM") == 1  # the engine was kept across the rejoins
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for learner in learners.values():
            learner.close()
