"""The learner's server over real ZeroMQ sockets: it keeps the Prometheus SD file in step with membership
(an actor's reported endpoint is listed under its id, a malformed one is a counted bad message that
changes nothing, and an actor that says goodbye leaves the file), and it sizes each actor's weight-sync
group from the engine's worker count, given after hello; an actor whose group never forms is presumed
dead without stopping the server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from actors.session import join, request, weight_group
from exgrpo_async.config import RunConfig
from exgrpo_async.weight_sync import WeightPublisher
from exgrpo_async.wire import encode_control
from learner.dispatch import Dispatcher
from learner.metrics import TargetsFile
from learner.server import LearnerServer


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _server(timeout_s: float) -> LearnerServer:
    cfg = RunConfig.model_validate({"weight_sync": {"timeout_s": timeout_s}})
    publisher = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), 1, timeout_s)
    publisher.publish(0, [("w", torch.zeros(4))])
    dispatcher = Dispatcher(lambda: 0, 1, 2, 1.0, max_staleness=0)
    return LearnerServer(cfg, dispatcher, publisher, "gloo", {"train": ["1+1="], "eval": []},
                         {"train": [], "eval": []}, cfg.model_dump_json())


def test_group_is_sized_by_the_engine_and_a_group_that_never_forms_drops_the_actor():
    server = _server(timeout_s=2)
    server.start()
    try:
        sock, welcome = join(server.address, None, 10, 5)
        assert "weights" not in welcome  # the group waits for the engine's real size
        sock.send(encode_control("sync", version=-1))  # before asking for its group: dropped, counted
        _wait_for(lambda: server.counters["bad_messages"] == 1)
        ws = weight_group(sock, 2, 5)  # a TP-2 engine: the learner and two workers
        assert ws["world_size"] == 3 and ws["prefix"].startswith("ws/1-") and ws["backend"] == "gloo"
        sock.send(encode_control("group", tp=2))  # twice: dropped, counted
        other, _ = join(server.address, None, 10, 5)
        other.send(encode_control("group", tp=0))  # no engine has 0 workers
        _wait_for(lambda: server.counters["bad_messages"] == 3)
        # nobody joins actor-1's group: it fails to form within weight_sync.timeout_s, the actor is
        # presumed dead (its requests are answered rejoin) and the server goes on serving the other
        _wait_for(lambda: server.counters["actors_lost"] == 1, timeout=20)
        assert server.counters["sync_failures"] == 1 and server.connected == 1
        assert request(other, encode_control("work", version=-1), 5)["t"] == "resync"
        assert sock.request(encode_control("work", version=-1), 5)[0]["t"] == "rejoin"
        for s in (sock, other):
            s.send(encode_control("bye"))
            s.close()
    finally:
        server.stop(wait_for_actors_s=0)


def test_sd_file_follows_actor_endpoints(tmp_path):
    cfg = RunConfig.model_validate({"weight_sync": {"timeout_s": 2}})  # no real peer joins the weight group
    publisher = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), 1, 2.0)
    publisher.publish(0, [("w", torch.zeros(4))])
    dispatcher = Dispatcher(lambda: 0, 1, 2, 1.0, max_staleness=0)
    server = LearnerServer(cfg, dispatcher, publisher, "gloo", {"train": ["1+1="], "eval": []},
                           {"train": [], "eval": []}, cfg.model_dump_json())
    run = tmp_path / "run-x"
    run.mkdir()
    server.targets = TargetsFile(run, None, "127.0.0.1:9000")
    server.start()
    targets = lambda: json.loads(Path(run / "prometheus-targets.json").read_text())  # noqa: E731
    try:
        sock, welcome = join(server.address, None, 10, 5)
        assert welcome["actor_id"] == "actor-1"
        assert len(targets()) == 1  # joined, but no endpoint reported yet
        reply = request(sock, encode_control("work", version=-1, metrics="127.0.0.1:9101"), 5)
        assert reply["t"] == "resync"
        assert targets()[1] == {"targets": ["127.0.0.1:9101"],
                                "labels": {"role": "actor", "actor_id": "actor-1", "run": "run-x"}}
        sock.send(encode_control("work", version=-1, metrics="evil host\n:1"))  # dropped, never answered
        _wait_for(lambda: server.counters["bad_messages"] == 1)
        assert targets()[1]["targets"] == ["127.0.0.1:9101"]
        sock.send(encode_control("bye"))
        _wait_for(lambda: server.connected == 0)
        # the server thread rewrites the file just after it forgets the actor: wait for it, not the count
        _wait_for(lambda: targets() == [{"targets": ["127.0.0.1:9000"], "labels": {"role": "learner", "run": "run-x"}}])
        sock.close()
    finally:
        server.stop(wait_for_actors_s=0)
        server.targets.close()
