"""The step's update, fed one group at a time as the groups arrive, so that the learner can compute
while the actors finish the step's last requests instead of idling until the batch is complete.

The loop hands each accepted group to `add` and calls `finish` once B groups are in. Two ways to do it:
- `Accumulator` (`learner.overlap_arrival`, one learner rank, one mini-batch per step): forwards and
  back-propagates a micro-batch as soon as the forwarded sequences already received fill one, and the
  rest after the last group. This is the same gradient as the whole-batch update, summation order
  apart: the loss scale D = B x K x L_max (learner/maths/loss_scale.py) is fixed before any group arrives
  (every group holds K sequences: the server re-issues a group of any other size), the weights do not
  change before the optimizer step, and every group's advantages are its own. The batch keeps arrival
  order: with one mini-batch, the order of groups changes nothing but that summation order. Its
  micro-batches are cut from the sequences received so far, so they are less alike in length than
  the whole batch's (more padding): on the CPU demo's two shared cores that made the run slower
  (docs/benchmarks.md), hence off by default.
- `WholeBatch` (the default, and any run of several ranks or mini-batches): collects the groups, then
  orders them at random into mini-batches and runs `update_policy` on every rank. Early micro-batches
  would need the follower ranks to join each of them, and a later mini-batch needs the update of the
  one before.
`busy` is the seconds `add` computed, so the loop counts the learner idle only while it had nothing
to compute.
"""

from __future__ import annotations

import random
import time

from exgrpo_async.rollout import RolloutGroup
from learner.dispatch import WorkItem
from learner.maths.batch import Batch, add_group, assemble, empty_batch, minibatch_order
from learner.maths.loss_scale import LossScale
from learner.maths.result import UpdateResult, finish_result, read_phases
from learner.maths.update import OptimizerUpdate, StepSettings, cut_micro_batches, forwarded
from learner.policy import Policy


class WholeBatch:
    """Every group first, then the update (the mini-batches' groups drawn at random, as the authors')."""

    def __init__(self, policy: Policy, settings: StepSettings, version: int, collecting: bool, rng: random.Random):
        self.policy, self.settings, self.version, self.collecting, self.rng = policy, settings, version, collecting, rng
        self.groups: list[tuple[WorkItem, RolloutGroup]] = []
        self.busy = 0.0

    def add(self, item: WorkItem, group: RolloutGroup) -> None:
        self.groups.append((item, group))

    def finish(self, updates_before: int) -> tuple[Batch, UpdateResult]:
        groups = minibatch_order(self.groups, self.rng)
        batch = assemble(groups, self.version, self.collecting)
        return batch, self.policy.update(batch.seqs, len(groups), self.settings, updates_before)


class Accumulator:
    """One mini-batch's gradient, accumulated micro-batch by micro-batch while its groups arrive."""

    def __init__(self, policy: Policy, settings: StepSettings, version: int, collecting: bool, n_groups: int):
        if policy.ranks.world > 1 or policy.cfg.learner.minibatches_per_step != 1:
            raise ValueError("Accumulator: one learner rank and one mini-batch per step only (WholeBatch otherwise)")
        self.policy, self.settings, self.version, self.collecting = policy, settings, version, collecting
        self.cfg = policy.cfg
        self.scale = LossScale(n_groups * self.cfg.rollout.samples_per_question, self.cfg.rollout.max_new_tokens)
        self.batch = empty_batch()
        self.res = UpdateResult()
        self.pending: list[int] = []  # forwarded sequences received, not yet in a micro-batch
        self.busy = 0.0
        self.update = OptimizerUpdate(policy.forward, policy.opt, self.cfg, settings, policy.device, policy.pad_id,
                                      self.res, self.scale)
        policy.model.train()

    def add(self, item: WorkItem, group: RolloutGroup) -> None:
        """Take the batch's next group; run every micro-batch the pending sequences fill, keeping the
        last (possibly partial) one pending."""
        t0 = time.perf_counter()
        seqs = add_group(self.batch, item, group, self.version, self.collecting)
        first = len(self.batch.seqs) - len(seqs)
        self.pending += [first + j for j, s in enumerate(seqs) if forwarded(s, self.cfg.learner)]
        parts = cut_micro_batches(self.batch.seqs, self.pending, self.cfg.learner)
        for part in parts[:-1]:
            self._micro(part)
        self.pending = parts[-1] if parts else []
        self.busy += time.perf_counter() - t0

    def finish(self, updates_before: int) -> tuple[Batch, UpdateResult]:
        """The pending sequences' micro-batches, then the optimizer update."""
        if len(self.batch.seqs) != self.scale.sequences:
            raise RuntimeError(f"the step's groups hold {len(self.batch.seqs)} sequences, but the loss scale was "
                               f"fixed for {self.scale.sequences} (B x K): a group of another size got through")
        try:
            for part in cut_micro_batches(self.batch.seqs, self.pending, self.cfg.learner):
                self._micro(part)
            if self.settings.nan_drill and not self.update.micro_batches:  # the drill fires on an all-zero batch too
                self._micro([0])
            self.update.step(updates_before)
            read_phases(self.res)
            finish_result(self.res)
        finally:
            self.policy.model.eval()
        return self.batch, self.res

    @property
    def micro_batches(self) -> int:
        return self.update.micro_batches

    def _micro(self, idx: list[int]) -> None:
        self.update.micro(self.batch.seqs, idx)
