"""Work dispatch: the learner decides which questions are rolled out, by whom, and how many samples.

Actors ask for work; the dispatcher answers from, in order of priority:
1. evaluation items (held-out questions, scored but never trained on);
2. ExGRPO experience items: K-1 fresh samples of a buffered question, sent with the trajectory that
   will be replayed beside them (the actor re-verifies it); re-issued ones (`reissue`, a released or
   expired actor's) go back to the front of this queue whole, replay included;
3. re-issued fresh training questions (their rollouts were dropped as too stale or malformed, or
   their actor left): K fresh samples again;
4. the next question of the shuffled training pool.
Training work is admitted only while `dispatched <= (version + 1 + max_staleness) * B` (AReaL-style
admission): rollouts are not generated in the first place if they could not be trained on within
`max_staleness` versions; a re-issue gives its admission back. Every dispatched item stays in
`outstanding` until its rollouts arrive, so nothing is lost silently: an item is either returned to
the learner or explicitly re-issued.
An experience item is *open* from `add_experience` until the learner calls `experience_done` for its
question (it trained the group, or gave it up): queued, dispatched, re-issued and received-but-untrained
items are all open, and `experience_in_flight()` lists their questions, so the learner never chooses a
question again while a group of it can still reach a batch.
Thread-safe: the server thread dispatches, the training loop completes and re-queues.
`state_dict`/`load_state_dict` carry the queues over a learner restart; work in flight then is lost
with the crashed process, so a checkpoint records it as queued again (see `state_dict`).
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from exgrpo_async.rollout import Purpose
from learner.maths.buffer import Trajectory

_ID_EPOCH = 1 << 40  # work ids of a restarted learner start at the next multiple (see load_state_dict)


@dataclass
class WorkItem:
    work_id: int
    question_id: int
    n: int
    purpose: Purpose
    temperature: float
    actor_id: str = ""
    dispatched_at: float = 0.0
    min_version: int = 0
    replay: Any = None  # ExGRPO: the stored trajectory replayed beside the n fresh samples
    seed: int | None = None  # vLLM sampling seed (set at dispatch when seeded sampling is on)
    version: int = -1  # the policy version of the actor it was handed to (it generates on those weights)


class Dispatcher:
    def __init__(self, next_question, questions_per_step: int, samples: int, temperature: float, max_staleness: int,
                 exclude_questions=None, sampling_seed: int | None = None, include_questions=None,
                 discard_displaced: bool = False):
        self._next_question = next_question  # callable -> question id (the epoch sampler)
        self._exclude_questions = exclude_questions  # callable(set of ids): drop from later epochs
        self._include_questions = include_questions  # callable(ids): back into later epochs (re-injection)
        self.B, self.K, self.temperature, self.eta = questions_per_step, samples, temperature, max_staleness
        self.sampling_seed = sampling_seed  # None: vLLM's own RNG; else every item gets a derived seed
        self.discard_displaced = discard_displaced  # an experience item queued uses up one fresh draw
        self.displaced_discarded = 0  # fresh draws discarded so (exgrpo.discard_displaced)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._retry: deque[int] = deque()
        self._eval: deque[WorkItem] = deque()
        self._experience: deque[WorkItem] = deque()
        self._open: dict[int, int] = {}  # question id -> open experience items (see experience_done)
        self.outstanding: dict[int, WorkItem] = {}
        self.version = 0
        self.train_dispatched = 0  # training questions handed out, re-issues included
        self.train_consumed = 0  # training questions trained on
        self.stopped = False

    def capacity(self) -> int:
        """Training questions that may still be handed out at the current version."""
        return (self.version + 1 + self.eta) * self.B - self.train_dispatched

    def take(self, actor_id: str, actor_version: int, max_items: int) -> list[WorkItem]:
        """Up to `max_items` items for one actor (eval first, then training within the admission cap)."""
        out: list[WorkItem] = []
        now = time.monotonic()
        with self._lock:
            if self.stopped:
                return out
            while self._eval and len(out) < max_items and self._eval[0].min_version <= actor_version:
                item = self._eval.popleft()
                item.work_id, item.actor_id, item.dispatched_at = next(self._ids), actor_id, now
                out.append(item)
            while self._experience and len(out) < max_items and self.capacity() > 0:
                item = self._experience.popleft()
                item.work_id, item.actor_id, item.dispatched_at = next(self._ids), actor_id, now
                self.train_dispatched += 1
                out.append(item)
            while len(out) < max_items and self.capacity() > 0:
                qid = self._retry.popleft() if self._retry else self._next_question()
                item = WorkItem(next(self._ids), qid, self.K, "train", self.temperature, actor_id, now)
                self.train_dispatched += 1
                out.append(item)
            for item in out:
                item.version = actor_version
                self.outstanding[item.work_id] = item
                if self.sampling_seed is not None:
                    item.seed = self._seed(item)
        return out

    def _seed(self, item: WorkItem) -> int:
        """A function of what the item is and when it is handed out, not of which actor gets it or of the
        work id (which a restarted learner changes): the same run replayed draws the same samples."""
        kind = {"train": 0, "eval": 1}[item.purpose] + 2 * (item.replay is not None)
        key = struct.pack("<qqqqqd", self.sampling_seed, item.question_id, self.version, kind, item.n, item.temperature)
        return zlib.crc32(key) & 0x7FFFFFFF

    def complete(self, work_id: int) -> WorkItem | None:
        """The item whose rollouts just arrived, or None if it is unknown or already completed."""
        with self._lock:
            return self.outstanding.pop(work_id, None)

    def reissue(self, item: WorkItem) -> None:
        """A training item whose rollouts could not be used (too stale, wrong group size, no valid replay
        reward) goes out again: a fresh one as its question id on the retry queue (K fresh samples, ahead
        of new questions); an experience one as a new item at the front of the experience queue with the
        same question, n, temperature and replay trajectory (it stays open). Either way it gives its
        admission back. Normally called after `complete`; if the item is still outstanding it is taken
        out, so a late reply to it is dropped."""
        if not isinstance(item, WorkItem):
            raise TypeError(f"reissue takes the WorkItem, not {type(item).__name__}")
        if item.purpose != "train":
            raise ValueError("only training items are re-issued")
        with self._lock:
            self.outstanding.pop(item.work_id, None)
            if item.replay is None:
                self._retry.append(item.question_id)
            else:
                self._experience.appendleft(WorkItem(0, item.question_id, item.n, "train", item.temperature,
                                                     min_version=item.min_version, replay=item.replay))
            self.train_dispatched -= 1  # the admission budget is for questions trained, not attempts

    def expiring(self, version: int) -> int:
        """Training items still out that were handed to an actor on `version`: with `version` the
        learner's minus eta, it can train their groups this step but not after it (Inbox.next_train)."""
        with self._lock:
            return sum(1 for w in self.outstanding.values() if w.purpose == "train" and w.version == version)

    def release_actor(self, actor_id: str) -> int:
        """Re-issue everything an actor held (it left or died); returns how many items."""
        with self._lock:
            return len(self._take_back(lambda w: w.actor_id == actor_id))

    def reissue_expired(self, deadline_s: float) -> list[WorkItem]:
        """Items outstanding longer than `deadline_s` (their actor died or froze) go out again; if their
        rollouts arrive later after all, `complete` no longer knows the work id and they are dropped,
        so no rollout is counted twice."""
        now = time.monotonic()
        with self._lock:
            return self._take_back(lambda w: now - w.dispatched_at > deadline_s)

    def _take_back(self, which) -> list[WorkItem]:
        """Move matching outstanding items back to the front of their queues, in dispatch order
        (caller holds the lock)."""
        items = sorted((w for w in self.outstanding.values() if which(w)), key=lambda w: w.work_id)
        for w in items:
            del self.outstanding[w.work_id]
            if w.purpose == "train":
                self.train_dispatched -= 1  # the admission budget is for questions trained, not attempts
                if w.replay is None:
                    self._retry.append(w.question_id)
        self._experience.extendleft(reversed([w for w in items if w.replay is not None]))
        self._eval.extendleft(reversed([w for w in items if w.purpose == "eval"]))
        return items

    def add_eval(self, question_ids: list[int], n: int, temperature: float, min_version: int) -> None:
        with self._lock:
            for qid in question_ids:
                self._eval.append(WorkItem(0, qid, n, "eval", temperature, min_version=min_version))

    def add_experience(self, plan: list[tuple[int, Any]], n: int) -> None:
        """Queue experience questions: (question id, trajectory to replay), each with n fresh samples.
        With `discard_displaced` each one also draws the fresh question it displaces and discards it (the
        authors' collate, which replaces fresh draws of the batch by experience): the sampler moves
        through an epoch of the pool at the on-policy pace. A re-issued item displaces nothing more."""
        with self._lock:
            for qid, traj in plan:
                self._experience.append(WorkItem(0, qid, n, "train", self.temperature, replay=traj))
                self._open[qid] = self._open.get(qid, 0) + 1
                if self.discard_displaced:
                    self._next_question()
                    self.displaced_discarded += 1

    def experience_done(self, question_ids: Iterable[int]) -> None:
        """Close one open experience item per id: the loop trained those experience groups (or gave them
        up for good). Pass only the question ids of experience groups (items with a replay), once per
        group, never those of fresh groups; an id with nothing open is ignored."""
        with self._lock:
            for qid in question_ids:
                left = self._open.get(qid, 0) - 1
                if left > 0:
                    self._open[qid] = left
                else:
                    self._open.pop(qid, None)

    def experience_in_flight(self) -> set[int]:
        """Question ids with an open experience item: queued, dispatched, re-issued, or received but not
        yet trained (open from `add_experience` until `experience_done`). The learner excludes these
        when it samples the next experience questions."""
        with self._lock:
            return set(self._open)

    def experience_queued(self) -> int:
        """Experience items queued and not yet handed out (the next dispatch block's share)."""
        with self._lock:
            return len(self._experience)

    def unretire(self, question_ids: list[int]) -> None:
        """Re-injected questions go back into the fresh pool from the next epoch on (the Table 7 ablation)."""
        if question_ids and self._include_questions is not None:
            with self._lock:
                self._include_questions(question_ids)

    def retire(self, question_ids: set[int]) -> None:
        """Retired questions leave the fresh pool from the next epoch on (under the dispatch lock,
        because the sampler is also read by the server thread)."""
        if question_ids and self._exclude_questions is not None:
            with self._lock:
                self._exclude_questions(question_ids)

    def trained(self, n_questions: int, version: int) -> None:
        """The loop trained on `n_questions` and moved to `version`."""
        with self._lock:
            self.train_consumed += n_questions
            self.version = version

    def stop(self) -> None:
        with self._lock:
            self.stopped = True

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self, received: Iterable[WorkItem] = (), sampler: Any = None) -> dict:
        """What a restarted learner needs to dispatch on as if nothing had been in flight.

        Rollouts being generated, and groups received but not yet trained on (`received`: the loop's
        inbox), die with a crashed learner, so they are recorded as queued again, in dispatch order:
        training question ids after the retry queue, experience items (with their replay trajectory)
        ahead of the queued ones, as `_take_back` does. Since nothing is in flight after the restart,
        `train_dispatched` restarts at `train_consumed`. The open experience counts are not saved:
        `load_state_dict` rebuilds them from the restored experience queue, which holds every open item
        that was not yet trained (so `experience_done` must have been called for the trained groups
        before this snapshot). Eval work is not kept: the loop re-runs an
        evaluation from the start. `sampler` (the question sampler behind `next_question`) is captured
        under the same lock, because `take` draws from it on the server thread: a question drawn
        between two separate snapshots would be lost or trained twice. Read-only for the live run.
        """
        with self._lock:
            pending = {w.work_id: w for w in self.outstanding.values()}
            pending.update({w.work_id: w for w in received})  # a group can be in both while in transit
            back = sorted((w for w in pending.values() if w.purpose == "train"), key=lambda w: w.work_id)
            experience = [w for w in back if w.replay is not None] + list(self._experience)
            nxt = next(self._ids)
            self._ids = itertools.count(nxt)  # peeking consumes; put the id back
            return {
                "version": self.version, "train_consumed": self.train_consumed, "next_work_id": nxt,
                "displaced_discarded": self.displaced_discarded,
                "retry": list(self._retry) + [w.question_id for w in back if w.replay is None],
                "experience": [_item_state(w) for w in experience],
                "sampler": sampler.state_dict() if sampler is not None else None,
            }

    def load_state_dict(self, state: dict, sampler: Any = None) -> None:
        """Restore queues and counters from `state_dict` (and `sampler`, if given, to its saved position);
        every restored experience item is open again. Call before the server starts handing out work."""
        with self._lock:
            self.version, self.train_consumed = int(state["version"]), int(state["train_consumed"])
            self.train_dispatched = self.train_consumed  # nothing is in flight after a restart
            self.displaced_discarded = int(state.get("displaced_discarded", 0))
            # actors outlive a learner crash and reconnect, so late replies to the old process's work
            # (issued up to the crash, past the saved counter) must not match a new item: work ids
            # move on to the next epoch of 2**40, which no process ever exhausts
            self._ids = itertools.count((int(state["next_work_id"]) // _ID_EPOCH + 1) * _ID_EPOCH)
            self._retry = deque(int(q) for q in state["retry"])
            self._experience = deque(
                WorkItem(0, int(e["question_id"]), int(e["n"]), "train", float(e["temperature"]),
                         min_version=int(e["min_version"]),
                         replay=Trajectory(np.asarray(e["token_ids"], np.int32), np.asarray(e["logprobs"], np.float32),
                                           int(e["version"])))
                for e in state["experience"])
            self._open = {}  # received and outstanding experience items were saved as queued again
            for w in self._experience:
                self._open[w.question_id] = self._open.get(w.question_id, 0) + 1
            self._eval.clear()
            self.outstanding.clear()
            if sampler is not None and state.get("sampler") is not None:
                sampler.load_state_dict(state["sampler"])


def _item_state(w: WorkItem) -> dict:
    t = w.replay
    return {"question_id": w.question_id, "n": w.n, "temperature": w.temperature, "min_version": w.min_version,
            "token_ids": np.asarray(t.token_ids, np.int32), "logprobs": np.asarray(t.logprobs, np.float32),
            "version": int(t.version)}
