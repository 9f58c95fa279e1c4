"""The learner's process shell: a ZeroMQ server thread and a weight-sync thread.

The server thread owns the learner socket. It registers actors, hands out work from the dispatcher,
decodes rollout groups into `inbox` (bounded by the dispatcher's admission cap), and turns sync
requests into jobs for the actor's own sync thread, which owns that actor's torch.distributed group.
The training loop in train.py only touches `inbox`, the dispatcher and the publisher, so training
never waits on a socket, a slow broadcast never blocks dispatch, and a frozen actor's broadcast never
holds back another actor's.

Membership is elastic: an actor joins with hello at any time; it leaves with bye, or is presumed dead
when neither it nor its heartbeat thread has been heard for `transport.actor_timeout_s` (kill -9,
SIGSTOP, a lost host). Either way its outstanding work is re-issued at once and its group is closed;
if a presumed-dead actor wakes up, its late rollouts are dropped (their work went out again) and its
requests are answered "rejoin".

Joining takes two messages: hello (answered with the actor's id and the run's config), then, once
the actor's engine is up, group with the engine's real worker count (its tensor-parallel size): only
then is the actor's weight-sync group sized and opened, so every TP worker of the engine is in it.

Malformed messages (bad msgpack, wrong schema version, wrong frame sizes, unknown types or work ids)
are counted in `counters` and dropped with a warning; they never stop the server.
"""

from __future__ import annotations

import logging
import queue
import re
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from exgrpo_async.config import RunConfig, is_loopback
from exgrpo_async.data import Question
from exgrpo_async.rollout import RolloutGroup
from exgrpo_async.transport import LearnerSocket
from exgrpo_async.weight_sync import WeightPublisher
from exgrpo_async.wire import WireError, decode_header, decode_rollouts, encode_control
from learner.dispatch import Dispatcher, WorkItem
from learner.metrics import TargetsFile

log = logging.getLogger("exgrpo_async.learner.server")
MAX_ENGINE_WORKERS = 64  # an engine's workers in one weight-sync group (tensor x pipeline parallel)
MAX_SOURCE_CHARS = 200  # a work item's data_source (a row value or a file stem) is a bounded string
# an actor's metrics endpoint as it reports it: host:port or [v6]:port, nothing else
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}")


def actor_idle_share(before: dict[str, tuple[float, float]], now: dict[str, tuple[float, float]]) -> float | None:
    """The actors' idle share between two snapshots of `LearnerServer.actor_busy`: 1 - seconds generating /
    seconds elapsed, summed over the actors in both; None if none is. A window, not the whole connection,
    so engine start-up and long-past stalls do not linger in it."""
    busy = elapsed = 0.0
    for actor, (b, t) in now.items():
        if actor in before:
            busy += max(0.0, b - before[actor][0])  # an actor that rejoined may have restarted its count
            elapsed += t - before[actor][1]
    return max(0.0, 1.0 - busy / elapsed) if elapsed > 0 else None


@dataclass
class ActorInfo:
    actor_id: str
    group_key: str
    version: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    metrics_address: str | None = None  # its Prometheus endpoint, host:port, as it reported it
    world: int | None = None  # its weight-sync group's size (1 + the engine's workers), once asked for
    lost: bool = False  # set by its sync thread when a broadcast timed out: presumed dead
    jobs: queue.Queue = field(default_factory=queue.Queue)  # weight-sync jobs for its sync thread


class LearnerServer:
    def __init__(self, cfg: RunConfig, dispatcher: Dispatcher, publisher: WeightPublisher, backend: str,
                 prompts: dict[str, list[str]], questions: dict[str, list[Question]], config_json: str):
        self.cfg, self.dispatcher, self.publisher, self.backend = cfg, dispatcher, publisher, backend
        self.prompts, self.questions, self.config_json = prompts, questions, config_json
        t = cfg.transport
        self.sock = LearnerSocket(t.host, t.port, t.max_message_mb << 20, keys_dir=t.curve_keys_dir)
        if not self.sock.secure and not is_loopback(t.host):
            log.warning("transport.host=%s without curve_keys_dir: anyone who reaches it can take work and inject "
                        "rollouts (transport.allow_insecure_remote)", t.host)
        self.address = self.sock.address
        self.inbox: queue.Queue[tuple[WorkItem, RolloutGroup]] = queue.Queue()
        self.actors: dict[bytes, ActorInfo] = {}
        self.counters: Counter[str] = Counter()
        self.sync_seconds: list[float] = []  # learner-side broadcast seconds, one per sync served
        self.update_timings: list[dict] = []  # actors' in-flight update seconds (pause, stall, total)
        # actor id -> (its seconds generating so far, when it said so): its last work request's busy_s
        self.actor_busy: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._n_actors = 0
        self._thread = threading.Thread(target=self._serve, name="zmq-server", daemon=True)
        self._sync_threads: list[threading.Thread] = []
        self.targets: TargetsFile | None = None  # Prometheus file SD: rewritten when membership changes
        self.on_sync = None  # callable(seconds) for each broadcast served (the Prometheus histogram)

    def start(self) -> None:
        self._thread.start()

    @property
    def joined(self) -> int:
        """Actors that ever said hello (rejoins included)."""
        return self._n_actors

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
                self._drop_silent_actors()
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
        elif kind == "alive":  # heartbeat, from the actor's own heartbeat socket
            alive = next((a for a in self.actors.values() if a.actor_id == head.get("actor_id")), None)
            if alive is not None:
                alive.last_seen = time.monotonic()
        elif info is None:
            if kind == "bye":  # the goodbye of a socket we already forgot (presumed dead, then rejoined)
                return
            if kind in ("work", "sync"):  # presumed dead, or from before a learner restart: start over
                self.counters["rejoin_requests"] += 1
                self.sock.send(peer, encode_control("rejoin"))
                return
            raise WireError(f"{kind!r} from an actor that never said hello (or was presumed dead)")
        elif kind == "work":
            self._work(peer, info, head)
        elif kind == "rollouts":
            self._rollouts(info, head, frames[1:])
        elif kind == "group":
            self._group(peer, info, head)
        elif kind == "sync":
            if info.world is None:
                raise WireError(f"sync from {info.actor_id} before it asked for its weight-sync group")
            version, meta, flat, token = self.publisher.checkout()
            info.jobs.put(("send", info.group_key, flat, token))
            self.sock.send(peer, encode_control("sync", version=version, meta=meta))
            info.version = version
        elif kind == "bye":
            n = self._remove(peer)
            log.info("%s left (%d items re-issued)", info.actor_id, n)
        else:
            raise WireError(f"unknown message type {kind!r}")

    def _hello(self, peer: bytes, head: dict) -> None:
        self._n_actors += 1
        # prefix of the group's store keys: 128 random bits, sent only in the group reply (encrypted with curve)
        info = ActorInfo(f"actor-{self._n_actors}", f"{self._n_actors}-{secrets.token_hex(16)}")
        self.actors[peer] = info
        self.counters["hellos"] += 1
        thread = threading.Thread(target=self._sync_worker, args=(info,), name=f"weight-sync-{info.actor_id}",
                                  daemon=True)
        thread.start()
        self._sync_threads = [t for t in self._sync_threads if t.is_alive()] + [thread]  # rejoins add threads
        self.sock.send(peer, encode_control("welcome", actor_id=info.actor_id, config=self.config_json))
        log.info("%s joined from %s (pid %s)", info.actor_id, head.get("host"), head.get("pid"))

    def _group(self, peer: bytes, info: ActorInfo, head: dict) -> None:
        """Size and open the actor's weight-sync group: rank 0 the learner, then its engine's `tp` workers."""
        tp = head.get("tp")
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_ENGINE_WORKERS:
            raise WireError(f"bad tp {tp!r} from {info.actor_id}")
        if info.world is not None:
            raise WireError(f"{info.actor_id} asked for its weight-sync group twice")
        info.world = 1 + tp
        info.jobs.put(("open", info.group_key, info.world))
        self.sock.send(peer, encode_control(
            "group", host=self.publisher.host, port=self.publisher.port, prefix=f"ws/{info.group_key}/",
            world_size=info.world, backend=self.backend, timeout_s=self.cfg.weight_sync.timeout_s))
        log.info("%s: weight-sync group of %d (tensor parallel %d)", info.actor_id, info.world, tp)

    def _remove(self, peer: bytes) -> int:
        """Forget an actor: re-issue its outstanding work, close its group, end its sync thread."""
        info = self.actors.pop(peer)
        self.actor_busy.pop(info.actor_id, None)
        self._update_targets()
        n = self.dispatcher.release_actor(info.actor_id)
        self.counters["work_released"] += n
        info.jobs.put(("close", info.group_key))
        info.jobs.put(None)
        return n

    def _drop_silent_actors(self) -> None:
        limit = self.cfg.transport.actor_timeout_s
        now = time.monotonic()
        for peer, info in list(self.actors.items()):
            if info.lost or now - info.last_seen > limit:
                n = self._remove(peer)
                self.counters["actors_lost"] += 1
                why = "its weight broadcast timed out" if info.lost else f"silent for {now - info.last_seen:.0f}s"
                log.warning("%s %s: presumed dead, %d work items re-issued", info.actor_id, why, n)

    def _update_targets(self) -> None:
        if self.targets is not None:
            self.targets.update({a.actor_id: a.metrics_address for a in self.actors.values() if a.metrics_address})

    def _note_actor_stats(self, info: ActorInfo, head: dict) -> None:
        """Optional fields of a work request: seconds spent generating, in-flight update timings, the
        actor's metrics endpoint."""
        address = head.get("metrics")
        if address is not None and address != info.metrics_address:
            if not isinstance(address, str) or not _ENDPOINT.fullmatch(address):
                raise WireError(f"bad metrics endpoint {str(address)[:80]!r}")
            info.metrics_address = address
            self._update_targets()
        busy = head.get("busy_s")
        if busy is not None:
            if not isinstance(busy, (int, float)) or isinstance(busy, bool) or busy < 0:
                raise WireError(f"bad busy_s {busy!r}")
            self.actor_busy[info.actor_id] = (float(busy), time.monotonic())
        updates = head.get("updates", [])
        if not isinstance(updates, list) or len(updates) > 64:
            raise WireError("bad updates field")
        for u in updates:
            if not isinstance(u, dict) or not all(isinstance(u.get(k), (int, float)) for k in ("pause", "stall", "total")):
                raise WireError("bad update timing")
            self.update_timings.append({k: float(u[k]) for k in ("pause", "stall", "total")})

    def _work(self, peer: bytes, info: ActorInfo, head: dict) -> None:
        self._note_actor_stats(info, head)
        if self.dispatcher.stopped:
            self.sock.send(peer, encode_control("stop"))
            return
        latest = self.publisher.version
        if info.version < latest:  # every batch is generated on the newest weights
            self.sock.send(peer, encode_control("resync", version=latest))
            return
        want = head.get("max_items", self.cfg.rollout.questions_per_request)
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            raise WireError(f"bad max_items {want!r}")
        items = self.dispatcher.take(info.actor_id, info.version, min(want, self.cfg.rollout.questions_per_request))
        if not items:
            self.sock.send(peer, encode_control("wait", seconds=0.05))
            return
        payload = []
        for it in items:
            pool = "eval" if it.purpose == "eval" else "train"
            q = self.questions[pool][it.question_id]
            entry = {"work_id": it.work_id, "question_id": it.question_id, "prompt": self.prompts[pool][it.question_id],
                     "answer": q.answer, "n": it.n, "temperature": it.temperature, "purpose": it.purpose,
                     "seed": it.seed, "data_source": q.source[:MAX_SOURCE_CHARS]}  # for a custom reward's row
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
                self.dispatcher.reissue(item)  # an experience item keeps its replay
            log.warning("work %d came back with %d of %d samples; re-issued", item.work_id, len(group.completions), item.n)
            return
        if item.replay is not None:
            r = group.extra.get("replay_reward")
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r <= 1.0:
                self.counters["bad_messages"] += 1
                self.dispatcher.reissue(item)
                log.warning("experience work %d came back without a valid replay reward; re-issued", item.work_id)
                return
        self.inbox.put((item, group))

    # ------------------------------------------------------------------ sync thread
    def _sync_worker(self, info: ActorInfo) -> None:
        """One per actor: opens its group, serves its syncs, closes it. A broadcast blocked on a frozen or
        dead actor only blocks this thread, until `weight_sync.timeout_s`: then its group is aborted and
        the actor presumed dead (the server thread drops it); other actors' groups are untouched."""
        while True:
            job = info.jobs.get()
            if job is None:
                return
            try:
                if job[0] == "open":
                    self.publisher.open_group(job[1], job[2])
                elif job[0] == "send":
                    try:
                        seconds = self.publisher.send(job[1], job[2])
                        self.sync_seconds.append(seconds)
                        if self.on_sync is not None:
                            self.on_sync(seconds)
                    finally:
                        self.publisher.release(job[3])
                elif job[0] == "close":
                    self.publisher.close_group(job[1])
            except Exception as e:  # a peer that died mid-sync must not take the learner down
                self.counters["sync_failures"] += 1
                log.warning("weight-sync job %s for %s failed: %s", job[0], info.actor_id, e)
                self.publisher.close_group(job[1], abort=True)
                if job[0] != "close":
                    info.lost = True

    # ------------------------------------------------------------------ shutdown
    def stop(self, wait_for_actors_s: float = 30.0) -> None:
        """Tell actors to stop (via their next work request), wait for their goodbyes, then close."""
        if self._stop.is_set():
            return
        self.dispatcher.stop()
        deadline = time.monotonic() + wait_for_actors_s
        while self.actors and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=5)
        for peer in list(self.actors):  # never said bye: close their groups anyway
            self._remove(peer)
        for t in self._sync_threads:
            t.join(timeout=5)
        self.sock.close()
