"""ZeroMQ transport between real processes: every rollout group sent is received exactly once, intact,
and a message above the size cap is refused by the learner socket without harming the others."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.transport import ActorSocket, LearnerSocket
from exgrpo_async.wire import decode_header, decode_rollouts, encode_control, encode_rollouts

GROUPS_PER_ACTOR = 300


def fake_group(actor: int, i: int) -> RolloutGroup:
    rng = np.random.default_rng(actor * 100_000 + i)
    comps = [Completion(rng.integers(0, 50_000, 64 + j, dtype=np.int32), rng.normal(size=64 + j).astype(np.float32),
                        float(j % 2), "stop") for j in range(4)]
    return RolloutGroup(work_id=i, question_id=actor, prompt_ids=np.arange(10, dtype=np.int32), completions=comps,
                        policy_version=i % 3, actor_id=f"actor-{actor}")


def actor_process(address: str, actor: int, oversized: bool) -> None:
    sock = ActorSocket(address)
    for i in range(GROUPS_PER_ACTOR):
        sock.send(encode_rollouts(fake_group(actor, i)))
        if oversized and i == 10:
            sock.send(encode_control("junk", blob=b"x" * (3 << 20)))  # above the 2 MiB cap below
    sock.send(encode_control("bye"))
    sock.close()


def test_every_group_arrives_once_and_intact():
    server = LearnerSocket("127.0.0.1", 0, max_message_bytes=2 << 20)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=actor_process, args=(server.address, a, a == 0)) for a in range(3)]
    for p in procs:
        p.start()
    seen: dict[tuple[int, int], int] = {}
    byes = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = server.recv(1000)
        if got is None:
            if byes == len(procs) - 1 and all(not p.is_alive() for p in procs):
                break  # the oversized sender was disconnected by ZeroMQ; its tail may be gone
            continue
        _, frames = got
        head = decode_header(frames[0].buffer)
        assert head["t"] != "junk", "a message above the size cap reached the learner"
        if head["t"] == "bye":
            byes += 1
            if byes == len(procs):
                break
            continue
        g = decode_rollouts(head, frames[1:])
        key = (g.question_id, g.work_id)
        seen[key] = seen.get(key, 0) + 1
        ref = fake_group(g.question_id, g.work_id)
        for a, b in zip(g.completions, ref.completions):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
    for p in procs:
        p.join(timeout=30)
    server.close()
    assert all(n == 1 for n in seen.values()), "a group was delivered twice"
    for actor in (1, 2):  # well-behaved actors: every group, exactly once
        assert {i for (a, i) in seen if a == actor} == set(range(GROUPS_PER_ACTOR))
