"""What both actor loops say to the learner: join, ask, heartbeat, and score what they generated.

The actor's side of the protocol (exgrpo_async/wire.py holds the messages): `join` says hello until a
learner welcomes it, `request` asks and checks the reply (`check_reply`: every field typed and in
range, or a ProtocolError), `weight_group` asks for the engine's weight-sync group, `Heartbeat` keeps
a busy actor alive from its own thread, and `score_groups` verifies a batch of completions and builds
the rollout groups. The batch loop (actors/loop.py) and the stream loop (actors/stream_loop.py) both
run on these; neither imports the other's code.
"""

from __future__ import annotations

import _thread
import logging
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import zmq

from actors.metrics import ActorMetrics, warn_verifier_timeouts
from actors.verifier import MathVerifier
from exgrpo_async.config import RunConfig
from exgrpo_async.config_io import config_from_json
from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.seams import ActorTransport, Engine, Verifier
from exgrpo_async.transport import ActorSocket
from exgrpo_async.wire import WireError, decode_header, encode_control

log = logging.getLogger("exgrpo_async.actor")


class LearnerLost(Exception):
    """The learner did not answer within `transport.request_timeout_s`."""


class ProtocolError(RuntimeError):
    """The learner answered with something this actor cannot use (junk, another schema version, an
    unexpected reply type or fields of the wrong type): the actor stops with this error."""


HELLO_ATTEMPT_S = 30.0  # default: a hello unanswered this long is said again (and logged), on a fresh socket
MAX_WAIT_S = 60.0  # the longest "wait" a learner may ask for
_NUM = (int, float)
# what each reply carries, checked before anything is used (bool is not an int here)
REPLY_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "welcome": {"actor_id": str, "config": str},
    "group": {"host": str, "port": int, "prefix": str, "world_size": int, "backend": str, "timeout_s": _NUM},
    "work": {"items": list, "version": int, "max_tokens": int},
    "sync": {"version": int, "meta": list},
    "resync": {"version": int}, "wait": {"seconds": _NUM}, "stop": {}, "rejoin": {},
}
ITEM_FIELDS: dict[str, type | tuple[type, ...]] = {"work_id": int, "question_id": int, "prompt": str, "answer": str,
                                                   "n": int, "temperature": _NUM, "purpose": str}


def check_reply(reply: dict, expected: tuple[str, ...], address: str) -> dict:
    """`reply` if it is one of the `expected` types with every field it needs, of the right type and in
    range; else ProtocolError naming what was wrong."""
    kind = reply["t"]

    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"the learner at {address} answered with a malformed {kind[:40]!r} ({what})")

    def typed(d: dict, fields: dict) -> None:
        for key, typ in fields.items():
            val = d.get(key)
            if not isinstance(val, typ) or isinstance(val, bool):
                raise bad(f"{key} is {type(val).__name__}")
            if isinstance(val, float) and not math.isfinite(val):
                raise bad(f"{key} is {val}")

    if kind not in expected:
        raise ProtocolError(f"the learner at {address} answered with {kind[:80]!r}, expected one of {list(expected)}")
    typed(reply, REPLY_FIELDS[kind])
    if kind == "welcome":
        if not re.fullmatch(r"actor-[0-9]{1,9}", reply["actor_id"]):
            raise bad(f"actor id {reply['actor_id'][:40]!r}")
        try:
            config_from_json(reply["config"])
        except Exception as e:  # a config this version cannot read: say so, not a traceback deep in the loop
            raise bad(f"config: {str(e)[:300]}") from None
    elif kind == "wait" and not 0 <= reply["seconds"] <= MAX_WAIT_S:
        raise bad(f"wait of {reply['seconds']}s")
    elif kind == "group" and not (1 <= reply["port"] < 65536 and reply["world_size"] >= 2
                                  and reply["backend"] in ("gloo", "nccl") and reply["timeout_s"] > 0):
        raise bad("port, world size, backend or timeout out of range")
    elif kind == "work":
        for it in reply["items"]:
            if not isinstance(it, dict):
                raise bad("a work item is not a map")
            typed(it, ITEM_FIELDS)
            seed = it.get("seed")
            if (it["n"] < 1 or it["purpose"] not in ("train", "eval") or not isinstance(it.get("replay_ids", b""), bytes)
                    or seed is not None and (not isinstance(seed, int) or isinstance(seed, bool))):
                raise bad("a work item's n, purpose, replay ids or seed")
    return reply


def join(address: str, keys_dir: str | None, patience_s: float, timeout_s: float,
         retry_s: float = HELLO_ATTEMPT_S) -> tuple[ActorSocket, dict]:
    """Say hello until a learner welcomes us (or `patience_s` runs out): (socket, welcome). An unanswered
    hello is said again every `retry_s` at most, each time logged; a learner with too many actors
    part-way through joining answers "wait" and is asked again; a malformed answer is a ProtocolError."""
    deadline = time.monotonic() + patience_s
    sock, last_wait_log = None, 0.0
    while True:
        if sock is None:
            sock = ActorSocket(address, keys_dir=keys_dir)
        attempt = min(timeout_s, retry_s, max(1.0, deadline - time.monotonic()))
        try:
            welcome, _ = sock.request(encode_control("hello", host=socket.gethostname(), pid=os.getpid()), attempt)
            welcome = check_reply(welcome, ("welcome", "wait"), address)
        except TimeoutError:
            sock.close()
            sock = None
            left = deadline - time.monotonic()
            if left <= 0:
                raise LearnerLost(f"no learner answered at {address}") from None
            log.warning("no answer from the learner at %s within %.0fs; saying hello again (%.0fs left)",
                        address, attempt, left)
            continue
        except (WireError, ProtocolError) as e:
            sock.close()
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"the learner at {address} answered hello with a malformed message ({e})") from None
        if welcome["t"] == "wait":  # too many actors are joining right now: not registered, ask again
            if time.monotonic() - last_wait_log > 30:
                log.warning("the learner at %s has too many actors joining; asking again every %gs",
                            address, welcome["seconds"])
                last_wait_log = time.monotonic()
            if time.monotonic() + welcome["seconds"] >= deadline:
                sock.close()
                raise LearnerLost(f"the learner at {address} kept refusing to let us join (too many joining)")
            time.sleep(welcome["seconds"])
            continue
        return sock, welcome


class Heartbeat:
    """Tells the learner "alive" every `interval_s` from its own thread and socket, so an actor busy in a
    long generation is never taken for dead; a killed or frozen (SIGSTOP) actor goes silent.

    The learner answers a beat with "stop" only once its run has ended and this actor has not asked for its
    weight-sync group yet (its engine still starting): `told_to_stop` is set then, and inside `interruptible()`
    the main thread gets a KeyboardInterrupt, so the engine's start (seconds to minutes) is cut short instead of
    keeping the learner and the launcher waiting for it to end."""

    def __init__(self, address: str, keys_dir: str | None, actor_id: str, interval_s: float):
        self._stop = threading.Event()
        self.told_to_stop = threading.Event()
        self.ignored = 0  # answers other than "stop" (a hostile or broken learner's)
        self._interruptible = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(address, keys_dir, actor_id, interval_s),
                                        name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self, address: str, keys_dir: str | None, actor_id: str, interval_s: float) -> None:
        sock = ActorSocket(address, keys_dir=keys_dir)
        try:
            while not self._stop.wait(interval_s):
                try:  # never block on a learner that is gone: a missed beat is what silence means
                    sock.sock.send_multipart(encode_control("alive", actor_id=actor_id), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                for _ in range(16):  # what a beat's wait let in, bounded against a flood
                    if not sock.sock.poll(0):
                        break
                    self._answer(sock.sock.recv_multipart(), actor_id)
        finally:
            sock.close()

    def _answer(self, frames: list[bytes], actor_id: str) -> None:
        try:
            kind = decode_header(frames[0])["t"]
        except WireError as e:
            kind = f"malformed ({e})"
        if kind != "stop":  # nothing else is sent to a heartbeat: counted, the first few logged, the beats go on
            self.ignored += 1
            if self.ignored <= 3:
                log.warning("%s: the learner answered a heartbeat with %.80s; ignored%s", actor_id, kind,
                            " (no more such lines)" if self.ignored == 3 else "")
            return
        log.info("%s: the learner's run ended before we asked for its weights: stopping", actor_id)
        with self._lock:
            self.told_to_stop.set()
            if self._interruptible:
                _thread.interrupt_main()

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """While inside, a "stop" answer raises KeyboardInterrupt in the main thread (this must be it); the
        caller checks `told_to_stop` to tell it from the user's Ctrl-C."""
        with self._lock:
            if self.told_to_stop.is_set():
                raise KeyboardInterrupt
            self._interruptible = True
        # the stop reaches the main thread as SIGINT's Python handler (`_thread.interrupt_main`): the default one
        # raises KeyboardInterrupt, but under SIG_DFL or SIG_IGN, which a library may leave behind (seen: SIG_IGN in
        # a pytest worker, 2026-11-28), the interrupt does nothing and the start runs on
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            with self._lock:
                self._interruptible = False
            if old is not None:  # None: set outside Python, nothing to put back
                signal.signal(signal.SIGINT, old)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def request(sock: ActorTransport, frames: list, timeout_s: float) -> dict:
    """A request to the learner; LearnerLost when it is silent or asks us to rejoin (it restarted, or
    took us for dead)."""
    try:
        reply = sock.request(frames, timeout_s)[0]
    except TimeoutError as e:
        raise LearnerLost(str(e)) from None
    except WireError as e:
        raise ProtocolError(f"the learner at {sock.address} answered with a malformed message ({e})") from None
    if reply["t"] == "rejoin":
        raise LearnerLost("the learner asked us to rejoin")
    return check_reply(reply, tuple(k for k in REPLY_FIELDS if k != "welcome"), sock.address)


def weight_group(sock: ActorTransport, workers: int, timeout_s: float) -> dict:
    """Ask the learner for this actor's weight-sync group, sized for the engine's `workers` (its
    tensor-parallel size): host, port, prefix, world_size, backend, timeout_s."""
    reply = request(sock, encode_control("group", tp=workers), timeout_s)
    if reply["t"] != "group" or reply["world_size"] != 1 + workers:
        raise ProtocolError(f"the learner at {sock.address} answered the group request with {reply['t']!r} "
                            f"(world size {reply.get('world_size')!r}, expected {1 + workers})")
    return reply


def reward_row(item: dict) -> dict:
    """What a custom reward function learns about a work item's question (exgrpo_async/custom_reward.py)."""
    source = item.get("data_source")  # optional on the wire: "" from a learner that does not send it
    return {"question_id": item["question_id"], "data_source": source if isinstance(source, str) else "",
            "answer": item["answer"], "prompt": item["prompt"], "purpose": item["purpose"]}


def score_groups(verifier: Verifier, tokenizer, actor_id: str, done: list[tuple[dict, np.ndarray, list, int, float]],
                 metrics: ActorMetrics | None = None, timeout_warning_frac: float = 1.0) -> list[RolloutGroup]:
    """Verify every completion of `done` = [(work item, prompt ids, samples, version, gen seconds)] in
    one pool call, the ExGRPO replayed trajectories sent with experience items too (their reward goes
    to `extra`), and build the rollout groups. Warns when more than `timeout_warning_frac` of the
    call's verifications time out."""
    decode = lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
    texts = [(decode(s.token_ids), it["answer"]) for it, _, samples, _, _ in done for s in samples]
    rows = [reward_row(it) for it, _, samples, _, _ in done for _ in samples]
    replays = [(i, np.frombuffer(it["replay_ids"], dtype="<i4")) for i, (it, *_) in enumerate(done)
               if isinstance(it.get("replay_ids"), bytes)]
    texts += [(decode(ids), done[i][0]["answer"]) for i, ids in replays]
    rows += [reward_row(done[i][0]) for i, _ in replays]
    all_scores = verifier.score(texts, rows)
    statuses = [status for _, status in all_scores]
    warn_verifier_timeouts(actor_id, statuses, timeout_warning_frac)
    if metrics is not None:
        metrics.observe_verify(statuses, verifier.last_latencies)
    n_fresh = len(all_scores) - len(replays)
    replay_scores = {i: all_scores[n_fresh + j] for j, (i, _) in enumerate(replays)}
    scores = iter(all_scores[:n_fresh])
    groups = []
    for gi, (it, prompt_ids, samples, version, gen_s) in enumerate(done):
        comps = []
        for s in samples:
            reward, status = next(scores)
            comps.append(Completion(s.token_ids, s.logprobs, reward, s.finish_reason, status))
        extra = {}
        if gi in replay_scores:
            extra = {"replay_reward": replay_scores[gi][0], "replay_status": replay_scores[gi][1]}
        groups.append(RolloutGroup(it["work_id"], it["question_id"], np.asarray(prompt_ids, dtype=np.int32),
                                   comps, version, actor_id, it["purpose"], gen_s, extra))
    return groups


def engine_seed(cfg: RunConfig, actor_id: str) -> int:
    """Each actor's vLLM RNG seed: the learner seed plus the actor's number."""
    return cfg.learner.seed + int(actor_id.rsplit("-", 1)[-1])


def make_verifier(cfg: RunConfig) -> MathVerifier:
    v = cfg.actor.verifier
    return MathVerifier(v.workers, v.timeout_s, v.require_think, v.memory_limit_mb, v.function)


def work_request(version: int, busy_s: float, metrics: ActorMetrics | None, engine: Engine | None = None,
                 **extra) -> list:
    """A work request; it carries the actor's metrics endpoint so the learner can list it for Prometheus,
    and, once after each load the learner asked to fingerprint, the `engine`'s fingerprint of `version`."""
    if metrics is not None:
        extra["metrics"] = metrics.address
    if engine is not None and engine.fingerprint is not None:
        extra["fingerprint"], engine.fingerprint = engine.fingerprint, None
    return encode_control("work", version=version, busy_s=busy_s, **extra)


def load_options(sync: dict, cfg: RunConfig, stats: dict, actor_id: str) -> dict[str, bool]:
    """How to load a sync's weights: fingerprint them if the learner asks; corrupt them if this is a
    load `actor.fault_corrupt_load_at_syncs` names (the fault drill; loads counted from 1 per process)."""
    corrupt = stats["syncs"] + 1 in cfg.actor.fault_corrupt_load_at_syncs
    if corrupt:
        log.warning("%s: fault drill: corrupting the load of version %s", actor_id, sync["version"])
    return {"fingerprint": sync.get("fingerprint") is True, "corrupt": corrupt}
