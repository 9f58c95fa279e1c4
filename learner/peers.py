"""What the learner's server keeps of its peers, and how it reads what they report.

- `ActorInfo`: one joined actor (its id, weight-sync group, version, when last heard, its sync thread's jobs);
- `check_work_request`: a work request's optional fields (seconds generating, in-flight update timings, the
  actor's metrics endpoint, how many items it wants), each checked before any is used;
- `BadMessage` and `DropLog`: a dropped message's reason, and the rate-limited log of drops;
- `Tally`: values actors and sync threads report (bounded: a long run keeps no per-sync history);
- `actor_idle_share`: the actors' idle share over a window of their reports.
The server (learner/server.py) applies what these check.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from exgrpo_async.wire import WireError

log = logging.getLogger("exgrpo_async.learner.server")
DROP_LOG_FIRST = 10  # dropped messages logged one line each; after that, one summary line per period
DROP_LOG_EVERY_S = 30.0
# an actor's metrics endpoint as it reports it: host:port or [v6]:port, nothing else
ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}")
MAX_UPDATES_REPORTED = 64  # in-flight update timings in one work request


class BadMessage(WireError):
    """A message the server drops, with a short reason (the count by reason is what the log shows)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class DropLog:
    """Rate-limited warnings about dropped messages: the first `first` get a line each, then at most one
    summary line every `every_s` seconds with the counts by (counter, reason) since the last one. A peer
    sending junk as fast as it can therefore costs a few log lines a minute, not a line per frame."""

    def __init__(self, first: int = DROP_LOG_FIRST, every_s: float = DROP_LOG_EVERY_S):
        self.first, self.every_s = first, every_s
        self.total = 0
        self.pending: Counter[str] = Counter()
        self.last_detail = ""
        self.next_summary = time.monotonic() + every_s

    def note(self, counter: str, reason: str, detail: str, so_far: int, exc_info: bool = False) -> None:
        """One more drop, counted in `counter` (now at `so_far`)."""
        self.total += 1
        detail = detail if len(detail) <= 200 else detail[:200] + "..."
        if self.total <= self.first:
            log.warning("dropped a message (%s, %s): %s; %d so far%s", counter, reason, detail, so_far,
                        f" (after {self.first} such lines, one summary every {self.every_s:.0f}s)"
                        if self.total == self.first else "", exc_info=exc_info)
            return
        self.pending[f"{counter}/{reason}"] += 1
        self.last_detail = detail
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Log the summary if one is due (or `force`) and anything was dropped since the last one."""
        now = time.monotonic()
        if self.pending and (force or now >= self.next_summary):
            by = ", ".join(f"{k} {n}" for k, n in self.pending.most_common())
            log.warning("dropped %d more messages (%s); last: %s; %d dropped in all", sum(self.pending.values()),
                        by, self.last_detail, self.total)
            self.pending.clear()
        if force or now >= self.next_summary:
            self.next_summary = now + self.every_s


def seconds_ok(x) -> bool:
    """A finite, non-negative number of seconds (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


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


class Tally:
    """Values reported by actors or sync threads: those since the training loop last took them (at most
    `keep`), and the running count and sum of all, so a long run holds no per-sync history."""

    def __init__(self, keep: int = 10_000):
        self._lock = threading.Lock()
        self._new: list[float] = []
        self.keep, self.count, self.total = keep, 0, 0.0

    def add(self, x: float) -> None:
        with self._lock:
            if len(self._new) < self.keep:
                self._new.append(x)
            self.count += 1
            self.total += x

    def take(self) -> list[float]:
        with self._lock:
            out, self._new = self._new, []
            return out

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class ActorInfo:
    actor_id: str
    group_key: str
    version: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    metrics_address: str | None = None  # its Prometheus endpoint, host:port, as it reported it
    world: int | None = None  # its weight-sync group's size (1 + the engine's workers), once asked for
    lost: bool = False  # set by its sync thread when a broadcast timed out: presumed dead
    told_to_stop: bool = False  # the run ended while its engine was starting: told through its heartbeat
    jobs: queue.Queue = field(default_factory=queue.Queue)  # weight-sync jobs for its sync thread


class WorkRequest(NamedTuple):
    """A work request's optional fields, checked."""

    metrics: str | None  # the actor's Prometheus endpoint, host:port
    busy_s: float | None  # its seconds generating so far
    updates: list[dict]  # its in-flight updates since the last request: pause, stall, total seconds
    max_items: int  # work items it asks for at most


def check_work_request(head: dict) -> WorkRequest:
    """The optional fields of a work request, all checked before any is used (WireError names the first bad
    one): a bad request changes nothing."""
    address = head.get("metrics")
    if address is not None and (not isinstance(address, str) or not ENDPOINT.fullmatch(address)):
        raise WireError(f"bad metrics endpoint {str(address)[:80]!r}")
    busy = head.get("busy_s")
    if busy is not None and not seconds_ok(busy):
        raise WireError(f"bad busy_s {str(busy)[:80]!r}")
    updates = head.get("updates", [])
    if not isinstance(updates, list) or len(updates) > MAX_UPDATES_REPORTED:
        raise WireError("bad updates field")
    if not all(isinstance(u, dict) and all(seconds_ok(u.get(k)) for k in ("pause", "stall", "total")) for u in updates):
        raise WireError("bad update timing")
    want = head.get("max_items", 1)
    if not isinstance(want, int) or isinstance(want, bool) or want < 1:
        raise WireError(f"bad max_items {str(want)[:80]!r}")
    return WorkRequest(address, None if busy is None else float(busy), updates, want)
