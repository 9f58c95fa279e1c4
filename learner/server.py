"""The learner's process shell: a ZeroMQ server thread and a weight-sync thread.

The server thread owns the learner socket. It registers actors, hands out work from the dispatcher,
decodes rollout groups into `inbox` (bounded by the dispatcher's admission cap), and turns sync
requests into jobs for the sync thread, which owns every torch.distributed group. The training loop in
train.py only touches `inbox`, the dispatcher and the publisher, so training never waits on a socket
and a slow broadcast never blocks dispatch.

Malformed messages (bad msgpack, wrong schema version, wrong frame sizes, unknown types or work ids)
are counted in `counters` and dropped with a warning; they never stop the server.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from exgrpo_async.config import RunConfig
from exgrpo_async.data import Question
from exgrpo_async.rollout import RolloutGroup
from exgrpo_async.transport import LearnerSocket
from exgrpo_async.weight_sync import WeightPublisher
from exgrpo_async.wire import WireError, decode_header, decode_rollouts, encode_control
from learner.dispatch import Dispatcher, WorkItem

log = logging.getLogger("exgrpo_async.learner.server")


@dataclass
class ActorInfo:
    actor_id: str
    group_key: str
    version: int = -1
    last_seen: float = field(default_factory=time.monotonic)


class LearnerServer:
    def __init__(self, cfg: RunConfig, dispatcher: Dispatcher, publisher: WeightPublisher, backend: str,
                 prompts: dict[str, list[str]], questions: dict[str, list[Question]], config_json: str):
        self.cfg, self.dispatcher, self.publisher, self.backend = cfg, dispatcher, publisher, backend
        self.prompts, self.questions, self.config_json = prompts, questions, config_json
        self.sock = LearnerSocket(cfg.transport.host, cfg.transport.port, cfg.transport.max_message_mb << 20)
        self.address = self.sock.address
        self.inbox: queue.Queue[tuple[WorkItem, RolloutGroup]] = queue.Queue()
        self.actors: dict[bytes, ActorInfo] = {}
        self.counters: Counter[str] = Counter()
        self.sync_seconds: list[float] = []  # learner-side broadcast seconds, one per sync served
        self._jobs: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._n_actors = 0
        self._threads = [threading.Thread(target=self._serve, name="zmq-server", daemon=True),
                         threading.Thread(target=self._sync_worker, name="weight-sync", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def connected(self) -> int:
        return len(self.actors)

    # ------------------------------------------------------------------ server thread
    def _serve(self) -> None:
        next_check = time.monotonic() + 1.0
        while not self._stop.is_set():
            if time.monotonic() >= next_check:  # work held too long by a dead or frozen actor goes out again
                late = self.dispatcher.reissue_expired(self.cfg.transport.work_deadline_s)
                if late:
                    self.counters["work_reissued"] += len(late)
                    log.warning("re-issued %d work items held longer than %.0fs (actors: %s)", len(late),
                                self.cfg.transport.work_deadline_s, sorted({w.actor_id for w in late}))
                next_check = time.monotonic() + 1.0
            got = self.sock.recv(100)
            if got is None:
                continue
            peer, frames = got
            try:
                head = decode_header(frames[0].buffer)
                self._handle(peer, head, frames)
            except WireError as e:
                self.counters["bad_messages"] += 1
                log.warning("dropped a malformed message (%s); %d so far", e, self.counters["bad_messages"])

    def _handle(self, peer: bytes, head: dict, frames: list) -> None:
        kind = head["t"]
        info = self.actors.get(peer)
        if info is not None:
            info.last_seen = time.monotonic()
        if kind == "hello":
            self._hello(peer, head)
        elif info is None:
            raise WireError(f"{kind!r} from an actor that never said hello")
        elif kind == "work":
            self._work(peer, info, head)
        elif kind == "rollouts":
            self._rollouts(info, head, frames[1:])
        elif kind == "sync":
            version, meta, flat, token = self.publisher.checkout()
            self._jobs.put(("send", info.group_key, flat, token))
            self.sock.send(peer, encode_control("sync", version=version, meta=meta))
            info.version = version
        elif kind == "bye":
            n = self.dispatcher.release_actor(info.actor_id)
            self._jobs.put(("close", info.group_key))
            del self.actors[peer]
            log.info("%s left (%d items re-issued)", info.actor_id, n)
        else:
            raise WireError(f"unknown message type {kind!r}")

    def _hello(self, peer: bytes, head: dict) -> None:
        world = 1 + int(head.get("tp", 1))
        self._n_actors += 1
        info = ActorInfo(f"actor-{self._n_actors}", f"{self._n_actors}-{uuid.uuid4().hex[:8]}")
        self.actors[peer] = info
        self._jobs.put(("open", info.group_key, world))
        ws = {"host": self.publisher.host, "port": self.publisher.port, "prefix": f"ws/{info.group_key}/",
              "world_size": world, "backend": self.backend, "timeout_s": self.cfg.weight_sync.timeout_s}
        self.sock.send(peer, encode_control("welcome", actor_id=info.actor_id, config=self.config_json, weights=ws))
        log.info("%s joined from %s (pid %s)", info.actor_id, head.get("host"), head.get("pid"))

    def _work(self, peer: bytes, info: ActorInfo, head: dict) -> None:
        if self.dispatcher.stopped:
            self.sock.send(peer, encode_control("stop"))
            return
        latest = self.publisher.version
        if info.version < latest:  # every batch is generated on the newest weights
            self.sock.send(peer, encode_control("resync", version=latest))
            return
        items = self.dispatcher.take(info.actor_id, info.version, self.cfg.rollout.questions_per_request)
        if not items:
            self.sock.send(peer, encode_control("wait", seconds=0.05))
            return
        payload = []
        for it in items:
            pool = "eval" if it.purpose == "eval" else "train"
            q = self.questions[pool][it.question_id]
            entry = {"work_id": it.work_id, "question_id": it.question_id, "prompt": self.prompts[pool][it.question_id],
                     "answer": q.answer, "n": it.n, "temperature": it.temperature, "purpose": it.purpose}
            if it.replay is not None:  # ExGRPO: the actor re-verifies the replayed trajectory
                entry["replay_ids"] = it.replay.token_ids.astype("<i4").tobytes()
            payload.append(entry)
        self.sock.send(peer, encode_control("work", items=payload, version=latest,
                                            max_tokens=self.cfg.rollout.max_new_tokens))

    def _rollouts(self, info: ActorInfo, head: dict, frames: list) -> None:
        group = decode_rollouts(head, frames)
        item = self.dispatcher.complete(group.work_id)
        if item is None or item.question_id != group.question_id or item.purpose != group.purpose:
            self.counters["unknown_work"] += 1
            log.warning("dropped rollouts for unknown or finished work %d from %s", group.work_id, info.actor_id)
            return
        if len(group.completions) != item.n:
            self.counters["wrong_group_size"] += 1
            if item.purpose == "train":
                self.dispatcher.reissue(item.question_id)
            log.warning("work %d came back with %d of %d samples; re-issued", item.work_id, len(group.completions), item.n)
            return
        if item.replay is not None:
            r = group.extra.get("replay_reward")
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r <= 1.0:
                self.counters["bad_messages"] += 1
                self.dispatcher.reissue(item.question_id)
                log.warning("experience work %d came back without a valid replay reward; re-issued", item.work_id)
                return
        self.inbox.put((item, group))

    # ------------------------------------------------------------------ sync thread
    def _sync_worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "open":
                    self.publisher.open_group(job[1], job[2])
                elif job[0] == "send":
                    try:
                        self.sync_seconds.append(self.publisher.send(job[1], job[2]))
                    finally:
                        self.publisher.release(job[3])
                elif job[0] == "close":
                    self.publisher.close_group(job[1])
            except Exception as e:  # a peer that died mid-sync must not take the learner down
                self.counters["sync_failures"] += 1
                log.warning("weight-sync job %s for %s failed: %s", job[0], job[1], e)
                self.publisher.close_group(job[1])

    # ------------------------------------------------------------------ shutdown
    def stop(self, wait_for_actors_s: float = 30.0) -> None:
        """Tell actors to stop (via their next work request), wait for their goodbyes, then close."""
        self.dispatcher.stop()
        deadline = time.monotonic() + wait_for_actors_s
        while self.actors and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self.sock.close()
