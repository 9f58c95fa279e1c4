"""The learner's server keeps the Prometheus SD file in step with membership, over real ZeroMQ sockets:
an actor's reported endpoint is listed under its id, a malformed one is a counted bad message that
changes nothing, and an actor that says goodbye leaves the file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from actors.loop import join, request
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
        assert targets() == [{"targets": ["127.0.0.1:9000"], "labels": {"role": "learner", "run": "run-x"}}]
        sock.close()
    finally:
        server.stop(wait_for_actors_s=0)
        server.targets.close()
