"""The rollout record: what an actor produces and the learner consumes (seam 1 of 5).

A `RolloutGroup` is the K completions of one question, sampled by one actor under one policy version.
It carries no advantages: the learner computes those after it has formed the batch (ExGRPO mixes fresh
and replayed trajectories into one group). Arrays are numpy so they travel as raw ZeroMQ frames
(see `wire.py`) without a copy into msgpack.

Produced by: actors/loop.py. Consumed by: learner/train.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Purpose = Literal["train", "eval"]


@dataclass
class Completion:
    """One sampled completion of a question."""

    token_ids: np.ndarray
    """(T,) int32 sampled token ids, the final EOS included when generation stopped on it."""
    logprobs: np.ndarray
    """(T,) float32 log-prob of each sampled token under the behaviour policy (vLLM, at temperature T)."""
    reward: float
    """Verifier score in [0, 1]."""
    finish_reason: str
    """"stop" (EOS or stop string), "length" (hit max_new_tokens) or "abort"."""
    verify_status: str = "ok"
    """"ok", "timeout" (verifier deadline hit, reward 0) or "error" (worker crashed, reward 0)."""

    def __post_init__(self) -> None:
        if self.token_ids.shape != self.logprobs.shape:
            raise ValueError(f"token_ids {self.token_ids.shape} and logprobs {self.logprobs.shape} differ in shape")


@dataclass
class RolloutGroup:
    """The completions of one question from one work item."""

    work_id: int
    """Id of the work item the learner dispatched; a reply to unknown or finished work is dropped."""
    question_id: int
    """Learner-side id of the question (row index in the training pool, or in the eval file)."""
    prompt_ids: np.ndarray
    """(P,) int32 prompt token ids, as the actor's tokenizer produced them."""
    completions: list[Completion]
    """The K samples (fewer if the work item asked for fewer)."""
    policy_version: int
    """Version of the weights that generated every completion in this group."""
    actor_id: str
    """Which actor produced it."""
    purpose: Purpose = "train"
    """"train" rollouts feed the learner; "eval" ones are only scored."""
    gen_seconds: float = 0.0
    """Wall time the actor spent generating the batch this group came from."""
    extra: dict = field(default_factory=dict)
    """Small scalar annotations (never arrays); travels in the msgpack header."""

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    @property
    def num_tokens(self) -> int:
        return int(sum(len(c.token_ids) for c in self.completions))
