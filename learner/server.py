"""The learner's network side: a ZeroMQ server thread and a weight-sync thread (learner/shell.py holds them).

The server thread owns the learner socket. It registers actors, hands out work from the dispatcher,
decodes rollout groups into `received` (bounded by the dispatcher's admission cap), and turns sync
requests into jobs for the actor's own sync thread, which owns that actor's torch.distributed group.
The training loop in train.py only touches `received` (through learner/inbox.py), the dispatcher and the publisher, so training
never waits on a socket, a slow broadcast never blocks dispatch, and a frozen actor's broadcast never
holds back another actor's.

Membership is elastic: an actor joins with hello at any time; it leaves with bye, or is presumed dead
when neither it nor its heartbeat thread has been heard for `transport.actor_timeout_s` (kill -9,
SIGSTOP, a lost host; `transport.join_timeout_s` while its engine starts, before it asks for its group).
Either way its outstanding work is re-issued at once and its group is closed;
if a presumed-dead actor wakes up, its late rollouts are dropped (their work went out again) and its
requests are answered "rejoin".

Joining takes two messages: hello (answered with the actor's id and the run's config), then, once
the actor's engine is up, group with the engine's real worker count (its tensor-parallel size): only
then is the actor's weight-sync group sized and opened, so every TP worker of the engine is in it.

Half-joined actors are bounded: at most `transport.max_pending_joins` actors may have said hello
without their group having formed yet (an engine starting, a rendezvous under way, or a peer that
stalled there, whose rendezvous thread lasts until `weight_sync.timeout_s` even after it is dropped);
a hello beyond that is answered "wait" and counted (`joins_refused`), and the actor asks again. A sync
thread is started only when the actor asks for its group, and each group's rendezvous talks to the
store over its own connection, so a stalled peer costs only its own timeout, never another's join.

Malformed messages (bad msgpack, wrong schema version, wrong frame sizes, unknown types, requests
before hello, fields of the wrong type) are counted in `counters["bad_messages"]` and dropped, as are
rollouts for work this actor does not hold (`unknown_work`); they never stop the server, and no error
in handling one does either (counted as a bad message, reason "internal error"; logged, rate-limited
like the rest, the first ones with their traceback).
The log is rate-limited: the first few drops one line each, then one summary line per
`DROP_LOG_EVERY_S` (learner/peers.py) with the counts by reason.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import Counter

from exgrpo_async.config import RunConfig, is_loopback
from exgrpo_async.data import Question
from exgrpo_async.rollout import RolloutGroup
from exgrpo_async.seams import WeightSender
from exgrpo_async.transport import LearnerSocket
from exgrpo_async.wire import WireError, decode_header, decode_rollouts, encode_control
from learner.dispatch import Dispatcher, WorkItem
from learner.fingerprints import FingerprintCheck
from learner.metrics import TargetsFile
from learner.peers import ActorInfo, BadMessage, DropLog, Tally, check_work_request

log = logging.getLogger("exgrpo_async.learner.server")
MAX_ENGINE_WORKERS = 64  # an engine's workers in one weight-sync group (tensor x pipeline parallel)
MAX_SOURCE_CHARS = 200  # a work item's data_source (a row value or a file stem) is a bounded string
MESSAGE_TYPES = ("hello", "alive", "work", "rollouts", "group", "sync", "bye")  # what actors send
JOIN_RETRY_S = 5.0  # a hello refused for too many pending joins is told to try again this much later


class LearnerServer:
    def __init__(self, cfg: RunConfig, dispatcher: Dispatcher, publisher: WeightSender, backend: str,
                 prompts: dict[str, list[str]], questions: dict[str, list[Question]], config_json: str):
        self.cfg, self.dispatcher, self.publisher, self.backend = cfg, dispatcher, publisher, backend
        self.prompts, self.questions, self.config_json = prompts, questions, config_json
        t = cfg.transport
        self.sock = LearnerSocket(t.host, t.port, t.max_message_mb << 20, keys_dir=t.curve_keys_dir)
        if not self.sock.secure and not is_loopback(t.host):
            log.warning("transport.host=%s without curve_keys_dir: anyone who reaches it can take work and inject "
                        "rollouts (transport.allow_insecure_remote)", t.host)
        self.address = self.sock.address
        self.received: queue.Queue[tuple[WorkItem, RolloutGroup]] = queue.Queue()
        self.actors: dict[bytes, ActorInfo] = {}
        self.counters: Counter[str] = Counter()
        self.sync_seconds = Tally()  # learner-side broadcast seconds, one per sync served
        self.update_stalls = Tally()  # actors' in-flight updates: seconds the engine stood still
        self.update_pauses = Tally()  # and seconds their pause call took (drain or abort)
        # actor id -> (its seconds generating so far, when it said so): its last work request's busy_s
        self.actor_busy: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._ending = False  # set by stop(): the run is over, actors are being told so
        self._n_actors = 0
        self._thread = threading.Thread(target=self._serve, name="zmq-server", daemon=True)
        self._sync_threads: list[threading.Thread] = []
        # group key -> actor part-way through joining: said hello, group not formed yet (its rendezvous
        # may outlive the actor's membership); bounded by transport.max_pending_joins
        self._joining: dict[str, ActorInfo] = {}
        self.drops = DropLog()
        self.fingerprints = FingerprintCheck(publisher, self.counters)
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
                self.drops.flush()
                next_check = time.monotonic() + 1.0
            got = self.sock.recv(100)
            if got is None:
                continue
            peer, frames = got
            reason = "header"
            try:
                head = decode_header(frames[0].buffer)
                reason = head["t"] if head["t"] in MESSAGE_TYPES else "unknown type"
                self._handle(peer, head, frames)
            except WireError as e:
                self._drop("bad_messages", getattr(e, "reason", reason), str(e))
            except Exception as e:  # a bug in handling one message must not stop the server
                self._drop("bad_messages", "internal error", f"{type(e).__name__}: {e}", exc_info=True)

    def _drop(self, counter: str, reason: str, detail: str, exc_info: bool = False) -> None:
        """Count a dropped message and log it, rate-limited (`DropLog`)."""
        self.counters[counter] += 1
        self.drops.note(counter, reason, detail, self.counters[counter], exc_info=exc_info)

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
                if self._ending and alive.world is None and not alive.told_to_stop:
                    # the run has ended while its engine starts (no work, no group yet): it leaves now, not once its
                    # engine is up and it asks for work (test_faults.py's drill: the replacement for the killed actor)
                    alive.told_to_stop = True
                    self.sock.send(peer, encode_control("stop"))
                    log.info("%s: told to stop while its engine starts", alive.actor_id)
        elif info is None:
            if kind == "bye":  # the goodbye of a socket we already forgot (presumed dead, then rejoined)
                return
            # presumed dead, or from before a learner restart: every request is answered, so start over
            # (a "group" left unanswered kept a woken actor waiting out its whole request timeout)
            if kind in ("work", "sync", "group"):
                self.counters["rejoin_requests"] += 1
                self.sock.send(peer, encode_control("rejoin"))
                return
            if kind in MESSAGE_TYPES:
                raise BadMessage("not joined", f"{kind!r} from an actor that never said hello (or was presumed dead)")
            raise WireError(f"unknown message type {kind!r} from an actor that never said hello")
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
            check = self.cfg.weight_sync.fingerprint  # a tensor-parallel engine reports its workers' shares combined
            info.jobs.put(("send", info.group_key, flat, token, (version, meta) if check else None))
            self.sock.send(peer, encode_control("sync", version=version, meta=meta, fingerprint=check))
            info.version = version
        elif kind == "bye":
            n = self._remove(peer)
            log.info("%s left (%d items re-issued)", info.actor_id, n)
        else:
            raise WireError(f"unknown message type {kind!r}")

    def _hello(self, peer: bytes, head: dict) -> None:
        old = self.actors.get(peer)
        if old is not None:  # the same socket says hello again: its first registration ends here
            n = self._remove(peer)
            log.info("%s said hello again on the same socket: dropped its registration (%d items re-issued)",
                     old.actor_id, n)
        limit = self.cfg.transport.max_pending_joins
        if len(self._joining) >= limit:  # too many half-joined peers: ask this one to come back later
            self._drop("joins_refused", "too many pending joins",
                       f"hello refused: {len(self._joining)} actors are part-way through joining "
                       f"(transport.max_pending_joins={limit})")
            self.sock.send(peer, encode_control("wait", seconds=JOIN_RETRY_S))
            return
        self._n_actors += 1
        # prefix of the group's store keys: 128 random bits, sent only in the group reply (encrypted with curve)
        info = ActorInfo(f"actor-{self._n_actors}", f"{self._n_actors}-{secrets.token_hex(16)}")
        self.actors[peer] = info
        self._joining[info.group_key] = info
        self.counters["hellos"] += 1
        self.sock.send(peer, encode_control("welcome", actor_id=info.actor_id, config=self.config_json))
        log.info("%s joined from %.100r (pid %.20r)", info.actor_id, head.get("host"), head.get("pid"))

    def _group(self, peer: bytes, info: ActorInfo, head: dict) -> None:
        """Size and open the actor's weight-sync group: rank 0 the learner, then its engine's `tp` workers."""
        tp = head.get("tp")
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_ENGINE_WORKERS:
            raise WireError(f"bad tp {tp!r} from {info.actor_id}")
        if info.world is not None:
            raise WireError(f"{info.actor_id} asked for its weight-sync group twice")
        info.world = 1 + tp
        thread = threading.Thread(target=self._sync_worker, args=(info,), name=f"weight-sync-{info.actor_id}",
                                  daemon=True)
        thread.start()
        self._sync_threads = [t for t in self._sync_threads if t.is_alive()] + [thread]  # rejoins add threads
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
        if info.world is None:  # it never asked for its group: no sync thread, no rendezvous
            self._joining.pop(info.group_key, None)
        info.jobs.put(("close", info.group_key))
        info.jobs.put(None)
        return n

    def _drop_silent_actors(self) -> None:
        transport = self.cfg.transport
        now = time.monotonic()
        for peer, info in list(self.actors.items()):
            # an engine still starting (no group asked for yet) holds no work, and may starve its heartbeat
            limit = transport.join_timeout_s if info.world is None else transport.actor_timeout_s
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
        actor's metrics endpoint. All are checked before any is used: a bad request changes nothing."""
        req = check_work_request(head)
        if req.metrics is not None and req.metrics != info.metrics_address:
            info.metrics_address = req.metrics
            self._update_targets()
        if req.busy_s is not None:
            self.actor_busy[info.actor_id] = (req.busy_s, time.monotonic())
        for u in req.updates:
            self.update_stalls.add(float(u["stall"]))
            self.update_pauses.add(float(u["pause"]))

    def _work(self, peer: bytes, info: ActorInfo, head: dict) -> None:
        self._note_actor_stats(info, head)
        if "fingerprint" in head and not self.fingerprints.check(info.actor_id, info.version, head["fingerprint"]):
            info.version = -1  # the weights it runs are not the ones sent: send them again
        if self.dispatcher.stopped:
            self.sock.send(peer, encode_control("stop"))
            return
        latest = self.publisher.version
        if info.version < latest:  # every batch is generated on the newest weights
            self.sock.send(peer, encode_control("resync", version=latest))
            return
        want = head.get("max_items", self.cfg.rollout.questions_per_request)  # checked above
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
        # only the actor holding the work may complete it, and only with the question it was given: any
        # other reply (late, replayed, forged, or a wrong question id) leaves the item where it is
        held = self.dispatcher.outstanding.get(group.work_id)
        if (held is None or held.actor_id != info.actor_id or held.question_id != group.question_id
                or held.purpose != group.purpose):
            self._drop("unknown_work", "rollouts", f"rollouts for work {group.work_id} (question {group.question_id}) "
                       f"from {info.actor_id}, which does not hold it (unknown, finished, re-issued or another's)")
            return
        item = self.dispatcher.complete(group.work_id)
        if item is not held:  # re-issued by the training loop meanwhile
            self._drop("unknown_work", "rollouts", f"rollouts for work {group.work_id}, re-issued meanwhile")
            return
        if self.fingerprints.tainted(info.actor_id, group.policy_version, item.dispatched_at):
            self.counters["fingerprint_rejected_groups"] += 1
            self._give_back(item)
            return
        if len(group.completions) != item.n:
            self.counters["wrong_group_size"] += 1
            self._give_back(item)
            log.warning("work %d came back with %d of %d samples; re-issued", item.work_id, len(group.completions), item.n)
            return
        if item.replay is not None:
            r = group.extra.get("replay_reward")
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r <= 1.0:
                self.dispatcher.reissue(item)
                self._drop("bad_messages", "rollouts", f"experience work {item.work_id} came back without a valid "
                           "replay reward; re-issued")
                return
        self.received.put((item, group))

    def _give_back(self, item: WorkItem) -> None:
        """Put a completed item's question out again, its rollouts unused."""
        if item.purpose == "train":
            self.dispatcher.reissue(item)  # an experience item keeps its replay
        else:  # an eval item goes back on the eval queue: the evaluation waits for every question
            self.dispatcher.add_eval([item.question_id], item.n, item.temperature, item.min_version)

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
                    try:
                        self.publisher.open_group(job[1], job[2])
                    finally:  # formed or failed: no longer part-way through joining
                        self._joining.pop(info.group_key, None)
                elif job[0] == "send":
                    try:
                        if job[4] is not None:  # before the send: ready before the actor can report its own
                            self.publisher.fingerprint(*job[4], job[2])
                        seconds = self.publisher.send(job[1], job[2])
                        self.sync_seconds.add(seconds)
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
        """Tell actors to stop (via their next work request), wait for their goodbyes, then close. An actor
        not heard for 3 heartbeats (killed, frozen: a live one's heartbeat thread speaks every
        `heartbeat_s`, generating or not) is not waited for: it could not say goodbye before its timeout."""
        if self._stop.is_set():
            return
        self.dispatcher.stop()
        self._ending = True  # an actor whose engine is still starting is told so by its next heartbeat, and leaves
        deadline = time.monotonic() + wait_for_actors_s
        silent_s = max(3 * self.cfg.transport.heartbeat_s, 2.0)
        while time.monotonic() < deadline and any(time.monotonic() - a.last_seen < silent_s
                                                  for a in list(self.actors.values())):
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=5)
        for peer in list(self.actors):  # never said bye: close their groups anyway
            self._remove(peer)
        deadline = time.monotonic() + 5  # one wait for all: a rendezvous stuck on a stalled peer is not joined
        for t in self._sync_threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.drops.flush(force=True)
        self.sock.close()
