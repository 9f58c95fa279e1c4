"""ExGRPO's step-end rules, beside the buffer: retire, collect, switch, (re-inject), choose.

After each update, in the authors' order (docs/exgrpo.md):
1. retire every question whose group was solved K/K (the replayed trajectory counts toward k);
2. collect, once the delayed start has fired, the correct fresh trajectories of partly solved groups
   (1 <= k <= K-1) with their pi_past log-probs, and move each question to bucket k (an experience
   group whose only correct answer is the replay too: k = 1, nothing new stored);
3. switch: the first step whose batch pass@1 (fresh responses) exceeds `start_threshold` turns
   collection and replay on for good. The switch is tracked with ExGRPO off too: the loss's clip
   schedule (`learner.clip_schedule`) follows it in both arms, so an on-policy baseline differs from
   ExGRPO only by the replay;
4. re-inject (Table 7 ablation, off by default): every `reinject_every` steps a share of the retired
   questions is put back;
5. choose the next experience questions: the Gaussian bucket sampler draws, leaving out every question
   that still has an experience group open (queued, generating, or received but not yet trained), enough
   to bring the queued experience items to floor(rho x B); each gets its lowest-entropy stored
   trajectory under the current weights, and the dispatcher queues it with K-1 fresh samples.
Replay health (how often each question is replayed, how old the replayed trajectories are, what the
sampler's pools hold) is measured here too, for the metrics row.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections import Counter
from typing import Any, Iterable, Protocol

import numpy as np
import torch

from exgrpo_async.config import ExGRPOConfig
from learner.maths.batch import Batch, Seq
from learner.maths.buffer import ExperienceBuffer, Trajectory
from learner.maths.replay import Scorer, select_replays

log = logging.getLogger("exgrpo_async.learner")


class Dispatcher(Protocol):
    """What ExGRPO's bookkeeping asks of the dispatcher (learner/dispatch.py's `Dispatcher`)."""

    displaced_discarded: int

    def retire(self, question_ids: set[int]) -> None: ...
    def unretire(self, question_ids: list[int]) -> None: ...
    def add_experience(self, plan: list[tuple[int, Any]], n: int) -> None: ...
    def experience_done(self, question_ids: Iterable[int]) -> None: ...
    def experience_in_flight(self) -> set[int]: ...
    def experience_queued(self) -> int: ...


def _new_question_reward(batch: Batch) -> float | None:
    """Mean reward of the fresh completions of groups that are not experience groups (new questions)."""
    n = len(batch.fresh_rewards) - len(batch.experience_fresh_rewards)
    return (sum(batch.fresh_rewards) - sum(batch.experience_fresh_rewards)) / n if n else None


class Experience:
    def __init__(self, X: ExGRPOConfig, K: int, B: int, seed: int):
        self.X, self.K, self.B = X, K, B
        self.buffer = ExperienceBuffer(K, X.max_trajectories, seed=seed)
        self.started = not X.delayed_start  # the delayed-start switch (one-way)
        self.prompt_ids_of: dict[int, list[int]] = {}  # question id -> prompt token ids, for replay scoring
        self.bucket_at_selection: dict[int, int] = {}
        self.replays: Counter[int] = Counter()  # question id -> times replayed in a trained batch
        self.reinjected = 0
        self.replay_only_correct = 0  # experience groups whose every fresh sample was wrong (moved to bucket 1)

    @property
    def mixed(self) -> bool:
        """Collection and replay are on (ExGRPO enabled and the switch has fired)."""
        return self.X.enabled and self.started

    def end_step(self, step: int, batch: Batch, pi_past: dict[int, torch.Tensor], version: int,
                 dispatcher: Dispatcher, score: Scorer | None, rng: random.Random) -> dict:
        """Apply the rules to the step just trained (at learner `version`, before it goes up); returns the
        ExGRPO part of the metrics row (empty with ExGRPO off). `score` scores stored trajectories under
        the current weights (the selection pass)."""
        collecting = self.mixed  # as it was when the batch was assembled
        if self.X.enabled:
            self._retire_and_collect(batch, pi_past, dispatcher)
        pass_rate = sum(1.0 for r in batch.fresh_rewards if r >= 1.0) / max(1, len(batch.fresh_rewards))
        if not self.started and pass_rate > self.X.start_threshold:
            self.started = True
            log.info("step %d: batch pass@1 %.3f > %.2f: %s", step, pass_rate, self.X.start_threshold,
                     "experience collection and replay start" if self.X.enabled else "the clip schedule switches")
        if not self.X.enabled:
            return {}
        if self.X.reinject_every and step % self.X.reinject_every == 0:
            self._reinject(dispatcher, rng)
        t_sel = time.time()
        plan, pools = self._choose(dispatcher, score, rng) if self.mixed else ([], {})
        return {**self._metrics(batch, version, plan, pools, time.time() - t_sel, collecting),
                "displaced_discarded_total": dispatcher.displaced_discarded}

    # ------------------------------------------------------------------ the rules
    def _retire_and_collect(self, batch: Batch, pi_past: dict[int, torch.Tensor], dispatcher: Dispatcher) -> None:
        newly_retired = set()
        by_group: dict[int, list[tuple[int, Seq]]] = {}
        for i, s in enumerate(batch.seqs):
            if s.collect:
                by_group.setdefault(s.group, []).append((i, s))
        for gi, g in enumerate(batch.groups):
            if g.replay is not None:
                self.replays[g.question_id] += 1
            if self.X.retire and g.k == g.size:
                self.buffer.retire(g.question_id)
                newly_retired.add(g.question_id)
            elif gi in by_group or (g.replay is not None and 0 < g.k < g.size):
                # an experience group whose only correct answer is the replay (k = 1) has nothing new to
                # store, but its question moves to bucket 1 all the same: the authors count the replay in k
                self.prompt_ids_of[g.question_id] = g.prompt
                correct = [Trajectory(np.asarray(s.completion, np.int32),
                                      (pi_past[i] if self.X.pi_past == "learner" else s.logprobs).numpy(),
                                      g.policy_version) for i, s in by_group.get(gi, [])]
                self.replay_only_correct += g.replay is not None and not correct
                self.buffer.record(g.question_id, g.k, correct)
        self.buffer.end_step()
        dispatcher.retire(newly_retired)
        dispatcher.experience_done([g.question_id for g in batch.groups if g.replay is not None])

    def _reinject(self, dispatcher: Dispatcher, rng: random.Random) -> None:
        retired = sorted(self.buffer.retired)
        back = rng.sample(retired, int(len(retired) * self.X.reinject_frac)) if retired else []
        if back:
            self.buffer.unretire(back)
            dispatcher.unretire(back)
            self.reinjected += len(back)
            log.info("re-injected %d of %d retired questions", len(back), len(retired))

    def _choose(self, dispatcher: Dispatcher, score: Scorer | None, rng: random.Random) -> tuple[list, dict[int, int]]:
        X = self.X
        open_ = dispatcher.experience_in_flight()
        want = int(X.rho * self.B) - dispatcher.experience_queued()
        pools = self.buffer.bucket_sizes(exclude=open_)
        chosen = self.buffer.sample_questions(want, X.question_weighting, X.mu, X.sigma, X.units, exclude=open_)
        if not chosen:
            return [], pools
        plan = select_replays(score, [(q, self.prompt_ids_of[q], self.buffer.trajectories(q)) for q in chosen],
                              X.selection, X.selection_metric, rng)
        self.bucket_at_selection.update({q: self.buffer.bucket_of(q) for q in chosen})
        dispatcher.add_experience([(q, t) for q, t, _ in plan], n=self.K - 1)
        return plan, pools

    # ------------------------------------------------------------------ metrics and state
    def _metrics(self, batch: Batch, version: int, plan: list, pools: dict[int, int], selection_s: float,
                 collecting: bool) -> dict:
        exp = [g for g in batch.groups if g.replay is not None]
        buckets = [self.bucket_at_selection.get(g.question_id) for g in exp]
        ages = [version - g.replay.version for g in exp]
        counts = heapq.nlargest(10, self.replays.values())  # not a full sort of every replayed question per step
        total = sum(self.replays.values())
        return {
            "exgrpo_mixed": self.mixed, "exgrpo_collecting": collecting,
            "buffer_questions": self.buffer.num_questions, "buffer_trajectories": self.buffer.num_trajectories,
            "buffer_tokens": self.buffer.num_tokens, "buffer_bytes": self.buffer.nbytes,
            "retired_total": len(self.buffer.retired), "reinjected_total": self.reinjected,
            "buckets": self.buffer.bucket_sizes(), "sampler_pools": pools,
            "experience_questions": len(exp),
            "experience_by_bucket": {b: buckets.count(b) for b in sorted(set(buckets), key=str)},
            "replay_reward_mean": sum(batch.replay_rewards) / len(batch.replay_rewards) if batch.replay_rewards else None,
            "experience_fresh_reward_mean": (sum(batch.experience_fresh_rewards) / len(batch.experience_fresh_rewards)
                                             if batch.experience_fresh_rewards else None),
            "new_question_reward_mean": _new_question_reward(batch),
            "replay_age_mean": sum(ages) / len(ages) if ages else None, "replay_age_max": max(ages, default=None),
            "replayed_questions_total": len(self.replays), "replays_total": total,
            "replay_count_mean": total / len(self.replays) if self.replays else None, "replay_count_max": counts[0] if counts else None,
            "replay_top10_share": sum(counts[:10]) / total if total else None,
            "selected_entropy_mean": sum(sc for _, _, sc in plan) / len(plan) if plan else None,
            "selection_seconds": selection_s,
            "replay_only_correct_total": self.replay_only_correct,
        }

    def state_dict(self) -> dict:
        return {"mixed": self.started, "bucket_at_selection": self.bucket_at_selection,
                "replays": dict(self.replays), "reinjected": self.reinjected,
                "replay_only_correct": self.replay_only_correct}

    def load_state_dict(self, st: dict, prompt_ids_of: dict[int, list[int]]) -> None:
        self.started = st["mixed"]
        self.bucket_at_selection.update(st["bucket_at_selection"])
        self.replays.update({int(q): int(n) for q, n in st.get("replays", {}).items()})
        self.reinjected = int(st.get("reinjected", 0))
        self.replay_only_correct = int(st.get("replay_only_correct", 0))
        self.prompt_ids_of.update(prompt_ids_of)
