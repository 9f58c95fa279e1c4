"""What the loop receives: the inbox that sorts training and eval groups, held-out evaluation, and the
question books (every training question handed out is accounted for)."""

from __future__ import annotations

import logging
import queue
import time

from exgrpo_async.config import RunConfig
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
            item, group = self.server.inbox.get(timeout=timeout)
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
                item, group = self.server.inbox.get_nowait()
            except queue.Empty:
                return
            self.add(item, group)

    def add(self, item: WorkItem, group: RolloutGroup) -> None:
        (self.eval if item.purpose == "eval" else self.train).append((item, group))


def source_score(by_source: dict[str, float], exclude: list[str]) -> float | None:
    """The score that picks the best weights: the mean of the sources' accuracies, `exclude` left out
    (None if nothing is left)."""
    kept = [acc for src, acc in by_source.items() if src not in exclude]
    return sum(kept) / len(kept) if kept else None


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
    per_source: dict[str, list[float]] = {}
    for it, g in inbox.eval:
        if it.temperature > 0:
            per_source.setdefault(sources[it.question_id], []).extend(g.rewards)
    by_source = {src: sum(r) / len(r) for src, r in sorted(per_source.items())}
    versions = {g.policy_version for _, g in inbox.eval}
    inbox.eval.clear()
    return {"accuracy": sum(sampled) / len(sampled), "greedy_accuracy": sum(greedy) / len(greedy),
            "by_source": by_source, "score": source_score(by_source, cfg.learner.best_exclude_sources),
            "versions": sorted(versions), "seconds": time.time() - t0}


def question_books(dispatcher: Dispatcher, inbox: Inbox, server: LearnerServer) -> dict:
    """Conservation of training questions: each one handed out is trained on, re-issued (which takes it
    off `train_dispatched`), still outstanding, or received and waiting. Anything else was lost."""
    waiting = len(inbox.train) + sum(1 for it, _ in list(server.inbox.queue) if it.purpose == "train")
    outstanding = sum(1 for w in list(dispatcher.outstanding.values()) if w.purpose == "train")
    return {"questions_dispatched": dispatcher.train_dispatched, "questions_trained": dispatcher.train_consumed,
            "questions_in_flight_at_end": outstanding + waiting,
            "questions_unaccounted": dispatcher.train_dispatched - dispatcher.train_consumed - outstanding - waiting}
