"""A step's batch: the received groups flattened into the sequences the update trains on.

`assemble` turns (work item, rollout group) pairs into `Seq`s with their group-relative advantages: an
ExGRPO experience group is its replayed trajectory in slot 0 plus K-1 fresh samples, one shared baseline;
the correct samples of partly solved groups are marked for the experience buffer once ExGRPO collects.
`Batch` carries them with the step's bookkeeping (rewards by kind, staleness, truncations, verifier
timeouts and errors, fresh tokens) for the metrics and ExGRPO's buffer (learner/maths/experience.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from exgrpo_async.rollout import RolloutGroup
from learner.maths.grpo import group_advantages


class WorkItem(Protocol):
    """What the update reads of a dispatched work item (learner/dispatch.py's `WorkItem`)."""

    work_id: int
    question_id: int
    replay: Any  # ExGRPO: the replayed Trajectory, or None


@dataclass
class Seq:
    """One completion as the update sees it."""

    prompt: list[int]
    completion: list[int]
    logprobs: torch.Tensor  # behaviour log-probs (fresh) or pi_past (replayed), per completion token
    advantage: float
    staleness: int  # learner version minus the version that generated it
    group: int  # index of its group in the batch
    replay: bool  # an ExGRPO replayed trajectory (off-policy tokens)
    collect: bool  # goes into the experience buffer after this step


@dataclass
class Group:
    """One group of the step, for ExGRPO's bookkeeping and the metrics."""

    question_id: int
    k: int  # correct responses, the replayed one included
    size: int
    prompt: list[int]
    policy_version: int
    replay: object = None  # the replayed Trajectory, if an experience group


@dataclass
class Batch:
    seqs: list[Seq]
    groups: list[Group]
    fresh_rewards: list[float]  # every fresh completion
    replay_rewards: list[float]
    experience_fresh_rewards: list[float]  # the K-1 fresh completions of experience groups (a subset)
    staleness: list[int]
    truncated: int
    fresh_tokens: int
    verify_timeouts: int
    verify_errors: int


def minibatch_order(batch: list[tuple[WorkItem, RolloutGroup]], rng: random.Random) -> list:
    """The step's groups in a seeded random order (mini-batch m takes the m-th slice): experience items,
    dispatched first, would otherwise all land in the first optimizer update. Sorted by work id first,
    so the order depends on the seed, not on arrival."""
    out = sorted(batch, key=lambda b: b[0].work_id)
    rng.shuffle(out)
    return out


def assemble(batch: list[tuple[WorkItem, RolloutGroup]], version: int, collecting: bool) -> Batch:
    """Flatten groups into sequences with their advantages; mark correct ones of partly solved groups
    for collection when `collecting` (ExGRPO's delayed start has fired)."""
    out = empty_batch()
    for item, g in batch:
        add_group(out, item, g, version, collecting)
    return out


def empty_batch() -> Batch:
    return Batch([], [], [], [], [], [], 0, 0, 0, 0)


def add_group(out: Batch, item: WorkItem, g: RolloutGroup, version: int, collecting: bool) -> list[Seq]:
    """Append one group (the batch's next) to `out`; returns its sequences."""
    gi, first = len(out.groups), len(out.seqs)
    comps = [(c.token_ids, c.logprobs, c.reward, False) for c in g.completions]
    if item.replay is not None:
        comps.insert(0, (item.replay.token_ids, item.replay.logprobs, float(g.extra["replay_reward"]), True))
    rewards = [c[2] for c in comps]
    k = sum(1 for r in rewards if r >= 1.0)
    out.groups.append(Group(item.question_id, k, len(comps), g.prompt_ids.tolist(), g.policy_version, item.replay))
    out.staleness.append(version - g.policy_version)
    for c in g.completions:
        out.verify_timeouts += c.verify_status == "timeout"
        out.verify_errors += c.verify_status == "error"
        out.truncated += c.finish_reason == "length"
        out.fresh_tokens += len(c.token_ids)
    for (ids, lps, reward, replay), a in zip(comps, group_advantages(rewards)):
        (out.replay_rewards if replay else out.fresh_rewards).append(reward)
        if item.replay is not None and not replay:
            out.experience_fresh_rewards.append(reward)
        collect = collecting and not replay and reward >= 1.0 and 0 < k < len(comps)
        out.seqs.append(Seq(g.prompt_ids.tolist(), ids.tolist(), torch.from_numpy(lps.copy()), a,
                            version - g.policy_version, gi, replay, collect))
    return out.seqs[first:]
