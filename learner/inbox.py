"""What the loop receives: the inbox that sorts training and eval groups and picks the order the step
trains them in, held-out evaluation, and the question books (every training question handed out is
accounted for)."""

from __future__ import annotations

import logging
import math
import queue
import statistics
import time
from collections.abc import Callable

from exgrpo_async.config import LearnerConfig, RunConfig
from exgrpo_async.rollout import RolloutGroup
from learner.dispatch import Dispatcher, WorkItem
from learner.server import LearnerServer

log = logging.getLogger("exgrpo_async.learner")


class Inbox:
    """Sorts what the server receives: training groups wait in `train`, eval groups are tallied."""

    def __init__(self, server: LearnerServer):
        self.server = server
        self.train: list[tuple[WorkItem, RolloutGroup]] = []
        self.eval: list[tuple[WorkItem, RolloutGroup]] = []
        self._last_warn = time.monotonic()

    def pump(self, timeout: float) -> None:
        try:
            item, group = self.server.received.get(timeout=timeout)
        except queue.Empty:
            if self.server.connected == 0 and time.monotonic() - self._last_warn > 30:
                log.warning("waiting for rollouts, but no actor is connected")
                self._last_warn = time.monotonic()
            return
        self.add(item, group)

    def drain(self) -> None:
        """Move everything the server has already received into this inbox (without waiting)."""
        while True:
            try:
                item, group = self.server.received.get_nowait()
            except queue.Empty:
                return
            self.add(item, group)

    def add(self, item: WorkItem, group: RolloutGroup) -> None:
        (self.eval if item.purpose == "eval" else self.train).append((item, group))

    def take_stale(self, version: int, eta: int) -> list[tuple[WorkItem, RolloutGroup]]:
        """Remove and return the training groups more than `eta` versions behind `version`."""
        stale = [(it, g) for it, g in self.train if version - g.policy_version > eta]
        if stale:
            self.train = [(it, g) for it, g in self.train if version - g.policy_version <= eta]
        return stale

    def next_train(self, version: int, eta: int, need: int, expiring: int) -> tuple[WorkItem, RolloutGroup] | None:
        """The training group the step trains next (removed from `train`), or None to wait for another.
        Call `take_stale` first. A group `eta` versions behind cannot be trained after this step, so
        those go first; then the others, oldest version first, arrival order among equals. One with
        slack is taken only while the batch, `need` groups short, has room for it beside the `expiring`
        items still being generated that are `eta` behind: otherwise newer groups fill the batch, and the
        older ones, arriving a step too late, are dropped and generated again (two actors, one slower)."""
        if not self.train:
            return None
        oldest = min(range(len(self.train)), key=lambda i: self.train[i][1].policy_version)
        if version - self.train[oldest][1].policy_version < eta and need <= expiring:
            return None
        return self.train.pop(oldest)


def fill_batch(inbox: Inbox, dispatcher: Dispatcher, version: int, L: LearnerConfig, hold_s: float,
               take: Callable[[WorkItem, RolloutGroup], None], waiting: Callable[[int], None]) -> int:
    """Hand `take` the step's B training groups in `Inbox.next_train`'s order; groups staler than eta are
    re-issued, and their count returned. With `L.wait_for_expiring`, groups that could wait a step are
    held back while items that cannot are still being generated, for at most `hold_s` (the previous
    step's time): past that an actor is frozen or far behind, and regenerating its work is cheaper.
    `waiting(taken)` is called on every wait (the stall warning)."""
    taken, dropped, hold_until = 0, 0, None
    while taken < L.questions_per_step:
        inbox.drain()
        for item, _ in inbox.take_stale(version, L.max_staleness):
            dispatcher.reissue(item)  # an experience item keeps its replayed trajectory
            dropped += 1
        holding = L.wait_for_expiring and (hold_until is None or time.monotonic() < hold_until)
        expiring = dispatcher.expiring(version - L.max_staleness) if holding else 0
        picked = inbox.next_train(version, L.max_staleness, L.questions_per_step - taken, expiring)
        if picked is None:
            if inbox.train and hold_until is None:  # groups held back: start the clock
                hold_until = time.monotonic() + hold_s
            holding_now = holding and hold_until is not None
            inbox.pump(min(0.5, max(0.01, hold_until - time.monotonic())) if holding_now else 0.5)
            waiting(taken)
            continue
        take(*picked)
        taken += 1
    return dropped


def source_score(by_source: dict[str, float], exclude: list[str]) -> float | None:
    """The score that picks the best weights: the mean of the sources' accuracies, `exclude` left out
    (None if nothing is left)."""
    kept = [acc for src, acc in by_source.items() if src not in exclude]
    return sum(kept) / len(kept) if kept else None


def standard_error(per_question: list[float]) -> float:
    """One evaluation's standard error: the spread of the per-question accuracies (each the mean of that
    question's samples) over the square root of their number, so both sources of noise count, which
    questions are in the set and how each one's samples fell. 0.0 with fewer than two questions."""
    return statistics.stdev(per_question) / math.sqrt(len(per_question)) if len(per_question) > 1 else 0.0


def sampling_error(per_question: list[list[float]]) -> float:
    """The standard error from the samples alone, the questions held fixed: what separates two policies
    scored on the same questions. Each question's mean of k rewards varies by its rewards' variance over
    k, estimated without bias by the sample variance over k: p^(1-p^)/(k-1) for 0/1 rewards. Questions
    with one sample add nothing (0.0 if none has two)."""
    var = sum(statistics.variance(r) / len(r) for r in per_question if len(r) > 1)
    return math.sqrt(var) / len(per_question) if per_question else 0.0


def paired_gain(before: dict, after: dict) -> dict | None:
    """The held-out gain from `before` to `after`, two evaluations of the same questions (run_eval's
    per-question accuracies), with the standard error of that paired difference: the spread over
    questions of each one's own change, over the square root of their number. Pairing takes out how
    hard the questions are, which the difference of two unpaired means would count twice. None when
    either lacks per-question figures (a run resumed from an older checkpoint)."""
    out: dict = {}
    for key, name in (("per_question", "sampled"), ("per_question_greedy", "greedy")):
        b, a = before.get(key), after.get(key)
        if not b or not a or len(a) != len(b):
            return None
        d = [y - x for x, y in zip(b, a) if x is not None and y is not None]
        if not d:
            return None
        out[name], out[f"{name}_se"], out[f"{name}_questions"] = sum(d) / len(d), standard_error(d), len(d)
    return out


def without_per_question(ev: dict) -> dict:
    """An evaluation without its per-question lists (for metrics.jsonl's rows)."""
    return {k: v for k, v in ev.items() if k not in ("per_question", "per_question_greedy")}


def run_eval(inbox: Inbox, dispatcher: Dispatcher, sources: list[str], cfg: RunConfig, version: int) -> dict:
    """Score the held-out set (question i from data source `sources[i]`) with the weights of `version`:
    avg@n sampled and greedy accuracy, overall and per source, and the best-weights score."""
    n_questions = len(sources)
    qids = list(range(n_questions))
    inbox.eval.clear()
    dispatcher.add_eval(qids, cfg.rollout.eval_samples, cfg.rollout.eval_temperature, version)
    dispatcher.add_eval(qids, 1, 0.0, version)
    t0 = time.time()
    while len(inbox.eval) < 2 * n_questions:
        inbox.pump(0.5)
    sampled = [r for it, g in inbox.eval if it.temperature > 0 for r in g.rewards]
    greedy = [r for it, g in inbox.eval if it.temperature == 0 for r in g.rewards]
    per_question = [[float(r) for r in g.rewards] for it, g in inbox.eval if it.temperature > 0 and g.rewards]
    by_qid = {it.question_id: float(sum(g.rewards)) / len(g.rewards) for it, g in inbox.eval if it.temperature > 0 and g.rewards}
    greedy_by_qid = {it.question_id: float(g.rewards[0]) for it, g in inbox.eval if it.temperature == 0 and g.rewards}
    per_source: dict[str, list[float]] = {}
    for it, g in inbox.eval:
        if it.temperature > 0:
            per_source.setdefault(sources[it.question_id], []).extend(g.rewards)
    by_source = {src: sum(r) / len(r) for src, r in sorted(per_source.items())}
    versions = {g.policy_version for _, g in inbox.eval}
    inbox.eval.clear()
    return {"accuracy": sum(sampled) / len(sampled), "greedy_accuracy": sum(greedy) / len(greedy),
            "accuracy_se": standard_error([sum(r) / len(r) for r in per_question]),
            "accuracy_sampling_se": sampling_error(per_question), "greedy_accuracy_se": standard_error(greedy),
            "questions": n_questions, "by_source": by_source, "score": source_score(by_source, cfg.learner.best_exclude_sources),
            "versions": sorted(versions), "seconds": time.time() - t0,
            # each question's accuracy by question id, for the paired gain (paired_gain); summary.json only
            "per_question": [by_qid.get(q) for q in qids], "per_question_greedy": [greedy_by_qid.get(q) for q in qids]}


def question_books(dispatcher: Dispatcher, inbox: Inbox, server: LearnerServer) -> dict:
    """Conservation of training questions: each one handed out is trained on, re-issued (which takes it
    off `train_dispatched`), still outstanding, or received and waiting. Anything else was lost."""
    waiting = len(inbox.train) + sum(1 for it, _ in list(server.received.queue) if it.purpose == "train")
    outstanding = sum(1 for w in list(dispatcher.outstanding.values()) if w.purpose == "train")
    return {"questions_dispatched": dispatcher.train_dispatched, "questions_trained": dispatcher.train_consumed,
            "questions_in_flight_at_end": outstanding + waiting,
            "questions_unaccounted": dispatcher.train_dispatched - dispatcher.train_consumed - outstanding - waiting}
