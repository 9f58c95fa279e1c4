"""Deterministic malformed and mutated frames for the learner's socket, and the protocol model that says
which of them the learner must count as bad.

`generate(seed, n)` returns `n` messages, each sent by one of `IDENTITIES` fuzz sockets (or, for the
ones above the size cap, by a fresh socket of its own). They are real messages from the wire encoders
(`encode_control`, `encode_rollouts`: every type an actor sends, plus reply types and unknown ones),
mutated (bytes flipped, cut or appended; fields deleted, added or given values of the wrong type, NaN,
huge ints, bools, nested junk; schema version and type changed; frames dropped, added, duplicated;
array frames truncated, lengthened, of another dtype; headers and frames of a megabyte or more), plain
junk, and earlier messages replayed.

The model (`Model.classify`) is the protocol as docs/architecture.md states it, per sending socket:
- a header that `decode_header` rejects is bad;
- hello is always valid (it registers the socket, a second one replaces the first registration);
  alive is always valid (a heartbeat; an unknown actor id is ignored);
- from a socket that is not registered: bye is ignored, work and sync are answered rejoin, any other
  type is bad;
- from a registered socket: work is valid iff its optional fields are (metrics host:port, busy_s and
  the update timings finite numbers >= 0, updates a list of at most 64, max_items an int >= 1);
  rollouts are valid iff `decode_rollouts` accepts them, and then counted as unknown work (a fuzz
  socket never holds work); group is valid iff tp is an int in 1..64 and it is the socket's first;
  sync is valid iff the socket asked for its group; bye unregisters it; any other type is bad.
Frames above `transport.max_message_mb` never reach the learner (ZeroMQ refuses them unread), so
they are not counted; the generator sends them on fresh sockets and says how many.

Two kinds of valid message are never generated, so the model stays exact whatever the timing: a
valid sync after a valid group (a fuzz socket would then be given real work), and more than
`MAX_GROUPS` valid group requests in all (each leaves a rendezvous waiting for `weight_sync.timeout_s`,
holding a pending-join slot).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

import msgpack
import numpy as np

from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.wire import SCHEMA_VERSION, WireError, decode_header, decode_rollouts, encode_control, encode_rollouts

IDENTITIES = 4
MAX_GROUPS = 6
OVERSIZED = -1  # "identity" of a message sent on a fresh socket (above the learner's size cap)
TYPES = ("hello", "alive", "work", "rollouts", "group", "sync", "bye")
REPLY_TYPES = ("welcome", "wait", "stop", "resync", "rejoin")
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}")


@dataclass
class Message:
    sender: int  # 0..IDENTITIES-1, or OVERSIZED
    frames: list[bytes]
    kind: str = ""  # the base message it was made from, for the record


@dataclass
class Tally:
    """What the learner must count, by the model."""

    bad: int = 0
    hellos: int = 0
    rejoins: int = 0
    unknown_work: int = 0
    groups: int = 0
    valid: int = 0  # valid messages of every other kind (alive, ignored bye, work, bye)
    oversized: int = 0
    by_kind: dict = field(default_factory=dict)


class Model:
    """The protocol state of each fuzz socket: registered (said hello), grouped (asked for its group)."""

    def __init__(self) -> None:
        self.registered = [False] * IDENTITIES
        self.grouped = [False] * IDENTITIES
        self.tally = Tally()

    def classify(self, sender: int, frames: list[bytes]) -> str:
        """The outcome of one message, without applying it: bad, hello, alive, ignored, rejoin, work,
        unknown_work, group, sync or bye."""
        try:
            head = decode_header(frames[0])
        except WireError:
            return "bad"
        kind = head["t"]
        if kind in ("hello", "alive"):
            return kind
        if not self.registered[sender]:
            return {"bye": "ignored", "work": "rejoin", "sync": "rejoin", "group": "rejoin"}.get(kind, "bad")
        if kind == "work":
            return "work" if _work_ok(head) else "bad"
        if kind == "rollouts":
            try:
                decode_rollouts(head, list(frames[1:]))
            except WireError:
                return "bad"
            return "unknown_work"
        if kind == "group":
            tp = head.get("tp")
            ok = isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= 64 and not self.grouped[sender]
            return "group" if ok else "bad"
        if kind == "sync":
            return "sync" if self.grouped[sender] else "bad"
        if kind == "bye":
            return "bye"
        return "bad"

    def apply(self, sender: int, outcome: str) -> None:
        t = self.tally
        if outcome == "bad":
            t.bad += 1
        elif outcome == "hello":
            t.hellos += 1
            self.registered[sender], self.grouped[sender] = True, False
        elif outcome == "rejoin":
            t.rejoins += 1
        elif outcome == "unknown_work":
            t.unknown_work += 1
        elif outcome == "group":
            t.groups += 1
            self.grouped[sender] = True
        elif outcome == "bye":
            t.valid += 1
            self.registered[sender] = self.grouped[sender] = False
        else:
            t.valid += 1
        t.by_kind[outcome] = t.by_kind.get(outcome, 0) + 1


def _seconds(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _work_ok(head: dict) -> bool:
    address = head.get("metrics")
    if address is not None and (not isinstance(address, str) or not _ENDPOINT.fullmatch(address)):
        return False
    if head.get("busy_s") is not None and not _seconds(head["busy_s"]):
        return False
    updates = head.get("updates", [])
    if not isinstance(updates, list) or len(updates) > 64:
        return False
    if not all(isinstance(u, dict) and all(_seconds(u.get(k)) for k in ("pause", "stall", "total")) for u in updates):
        return False
    want = head.get("max_items", 1)
    return isinstance(want, int) and not isinstance(want, bool) and want >= 1


# ---------------------------------------------------------------------------------------------- generation
def _group(rng: random.Random, nrng: np.random.Generator) -> RolloutGroup:
    n = rng.choice([1, 2, 4, 4, 4, 8])
    comps = []
    for _ in range(n):
        t = rng.randint(0, 40)
        comps.append(Completion(nrng.integers(0, 200, t, dtype=np.int32), nrng.normal(size=t).astype(np.float32),
                                rng.choice([0.0, 1.0, 0.5]), rng.choice(["stop", "length"]), "ok"))
    return RolloutGroup(work_id=rng.randint(1, 200), question_id=rng.randint(0, 60),  # a run's first ids
                        prompt_ids=nrng.integers(0, 200, rng.randint(0, 30), dtype=np.int32), completions=comps,
                        policy_version=rng.randint(-1, 20), actor_id=f"actor-{rng.randint(1, 9)}",
                        purpose=rng.choice(["train", "train", "eval"]), gen_seconds=rng.random() * 3,
                        extra=rng.choice([{}, {"replay_reward": 1.0, "replay_status": "ok"}]))


def _base(kind: str, rng: random.Random, nrng: np.random.Generator) -> list[bytes]:
    if kind == "hello":
        return encode_control("hello", host=rng.choice(["fuzz", "", "x" * 300]), pid=rng.randint(0, 1 << 20))
    if kind == "alive":
        return encode_control("alive", actor_id=rng.choice(["actor-1", "actor-2", "actor-77", "nobody"]))
    if kind == "work":
        fields = {"version": rng.randint(-1, 5), "busy_s": rng.random() * 100}
        if rng.random() < 0.5:
            fields["metrics"] = rng.choice(["127.0.0.1:9100", "gpu-3.cluster:9101", "[::1]:9"])
        if rng.random() < 0.4:
            fields["updates"] = [{"pause": rng.random(), "stall": rng.random(), "total": rng.random()}
                                 for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.4:
            fields["max_items"] = rng.randint(1, 8)
        return encode_control("work", **fields)
    if kind == "rollouts":
        return [bytes(memoryview(f).cast("B")) for f in encode_rollouts(_group(rng, nrng))]
    if kind == "group":
        return encode_control("group", tp=rng.choice([1, 2, 8]))
    if kind == "sync":
        return encode_control("sync", version=rng.randint(-1, 5))
    if kind == "bye":
        return encode_control("bye")
    if kind == "reply":
        return encode_control(rng.choice(REPLY_TYPES), seconds=0.05, version=1)
    return encode_control(rng.choice(["bogus", "", "HELLO", "hello ", "\u00e9t\u00e9", "t" * 5000, "rollout"]))


def _junk_value(rng: random.Random, depth: int = 0):
    """A value of a random type: the edge cases of each msgpack type, and small nested lists and maps."""
    if depth < 2 and rng.random() < 0.15:
        if rng.random() < 0.5:
            return [_junk_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["a", "tp", "pause", "stall", "total", "0"]): _junk_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return rng.choice([None, True, False, -1, 0, 1, 65, 1 << 63, -(1 << 63), (1 << 64) - 1, float("nan"),
                       float("inf"), -0.5, 1e308, "x" * rng.randint(0, 50), "127.0.0.1:9",
                       b"\x00\xff" * rng.randint(0, 20)])


def _mutate_fields(frames: list[bytes], rng: random.Random) -> list[bytes]:
    head = msgpack.unpackb(frames[0], raw=False)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        keys = list(head)
        if op < 0.35 and keys:
            head[rng.choice(keys)] = _junk_value(rng)
        elif op < 0.5 and keys:
            del head[rng.choice(keys)]
        elif op < 0.6:
            head[rng.choice(["extra", "zz", "tp", "busy_s", "max_items", "updates", "metrics", "lens"])] = _junk_value(rng)
        elif op < 0.7:
            head["t"] = rng.choice(TYPES + REPLY_TYPES + ("bogus",))
        elif op < 0.75:
            head["v"] = rng.choice([0, 2, SCHEMA_VERSION + 1, "1", 1.0, None])
        elif op < 0.9 and isinstance(head.get("lens"), list) and head["lens"]:  # lying sizes
            i = rng.randrange(len(head["lens"]))
            head["lens"][i] = rng.choice([head["lens"][i] + 1, max(0, head["lens"][i] - 1), 1 << 40, -1, (1 << 64) - 1])
        elif isinstance(head.get("rewards"), list) and head["rewards"]:
            head["rewards"][rng.randrange(len(head["rewards"]))] = rng.choice([2.0, -1.0, float("nan"), "1", None])
    try:
        return [msgpack.packb(head, use_bin_type=True), *frames[1:]]
    except OverflowError:  # a length pushed past 64 bits: msgpack cannot say that
        return frames


def _mutate_bytes(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    op = rng.random()
    if op < 0.3 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op < 0.55:
        b = b[:rng.randint(0, max(0, len(b) - 1))]  # truncated
    elif op < 0.75:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))  # trailing junk
    else:
        i = rng.randint(0, len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(b)


def _mutate_frames(frames: list[bytes], rng: random.Random, nrng: np.random.Generator) -> list[bytes]:
    frames = list(frames)
    op = rng.random()
    if op < 0.25 and len(frames) > 1:
        del frames[rng.randrange(1, len(frames))]  # a frame missing
    elif op < 0.45:
        frames.append(nrng.bytes(rng.choice([0, 4, 7, 64])))  # one too many
    elif op < 0.6 and len(frames) > 1:
        i = rng.randrange(1, len(frames))
        frames[i] = frames[i][:len(frames[i]) - rng.choice([1, 4])] if frames[i] else b"\x01"  # truncated array
    elif op < 0.75 and len(frames) == 4:  # the log-probs as float64, or token ids as int64: wrong dtype
        i = rng.choice([2, 3])
        arr = np.frombuffer(frames[i], dtype=np.int32 if i == 2 else np.float32)
        frames[i] = arr.astype(np.int64 if i == 2 else np.float64).tobytes()
    elif op < 0.85:
        frames = frames + frames[1:]  # duplicated arrays
    else:
        frames = frames[:1]  # header only
    return frames


def generate(seed: int, n: int, oversized: int = 3, cap_bytes: int = 2 << 20, big: int = 12,
             sweep: int = 1000) -> list[Message]:
    """`n` messages (`oversized` of them above `cap_bytes`, sent on fresh sockets; `big` of about a
    megabyte, under the cap), deterministic in `seed`, every one of which the model can classify.

    Somewhere in the middle, one socket says hello and sends well-formed rollouts for every work id
    1..`sweep` in turn (replayed or forged replies: whatever work a run has in flight then, in that
    range, is claimed by a socket that does not hold it)."""
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    model = Model()  # only to keep the forbidden kinds out; the caller classifies again as it sends
    groups = 0
    out: list[Message] = []
    sent: list[Message] = []
    sweep_at = rng.randrange(n // 3, max(n // 3 + 1, n - sweep - 1)) if sweep else n
    sweep_sender = rng.randrange(IDENTITIES)
    free = [i for i in range(n) if not sweep_at <= i <= sweep_at + sweep]
    specials = {i: "oversized" for i in rng.sample(free, oversized)}
    for _ in range(big):
        i = rng.choice(free)
        if i not in specials:
            specials[i] = "big"
    kinds = ["hello", "alive", "work", "work", "rollouts", "rollouts", "rollouts", "group", "sync", "bye",
             "reply", "unknown"]
    weights = [3, 4, 10, 10, 10, 10, 10, 7, 6, 3, 3, 4]
    for i in range(n):
        if specials.get(i) == "oversized":
            out.append(Message(OVERSIZED, [nrng.bytes(cap_bytes + rng.randint(1, 1 << 20))], "oversized"))
            continue
        if sweep and sweep_at <= i <= sweep_at + sweep:
            if i == sweep_at:
                frames, kind = _base("hello", rng, nrng), "sweep"
            else:
                g = _group(rng, nrng)
                g.work_id, g.extra = i - sweep_at, {}
                frames, kind = [bytes(memoryview(f).cast("B")) for f in encode_rollouts(g)], "sweep"
            outcome = model.classify(sweep_sender, frames)
            assert outcome == ("hello" if i == sweep_at else "unknown_work"), outcome
            model.apply(sweep_sender, outcome)
            out.append(Message(sweep_sender, frames, kind))
            continue
        sender = rng.randrange(IDENTITIES)
        while True:
            if specials.get(i) == "big":
                if rng.random() < 0.5:  # a header over MAX_HEADER_BYTES (1 MiB), under the socket's cap
                    frames, kind = [msgpack.packb({"v": SCHEMA_VERSION, "t": "work", "pad": "x" * ((1 << 20) + 10)})], "big"
                else:  # lying sizes: a megabyte and a half of array behind a header that says 3 tokens
                    frames = _base("rollouts", rng, nrng)
                    frames = [frames[0], frames[1], nrng.bytes(3 << 19), nrng.bytes(3 << 19)]
                    kind = "big"
            else:
                kind = rng.choices(kinds, weights)[0]
                r = rng.random()
                if kind == "replay" or (sent and r < 0.05):  # an earlier message again, as it was
                    frames, kind = list(rng.choice(sent).frames), "replay"
                elif r < 0.12:
                    frames, kind = [nrng.bytes(rng.randint(0, 512)) for _ in range(rng.choice([1, 1, 1, 2, 4]))], "junk"
                else:
                    frames = _base(kind, rng, nrng)
                    m = rng.random()
                    if m < 0.2:
                        pass  # as encoded
                    elif m < 0.6:
                        frames = _mutate_fields(frames, rng)
                    elif m < 0.8:
                        frames = [_mutate_bytes(frames[0], rng), *frames[1:]]
                    else:
                        frames = _mutate_frames(frames, rng, nrng)
            outcome = model.classify(sender, frames)
            if outcome == "sync" or (outcome == "group" and groups >= MAX_GROUPS):
                continue  # the two kinds never sent: draw again
            break
        groups += outcome == "group"
        model.apply(sender, outcome)
        msg = Message(sender, frames, kind)
        out.append(msg)
        if kind != "big":
            sent.append(msg)
    return out
