"""The loss's normalisation: one small object that owns the scale of a mini-batch's loss.

Every term of the objective is a sum over the mini-batch's valid completion tokens divided by one
denominator, fixed before the first micro-batch runs: D = (sequences in the mini-batch) x L_max, with
L_max the constant maximum response length (Dr.GRPO: no per-sequence or per-token mean, so a long
answer weighs by its token count and the scale never depends on the batch's lengths). Because each
micro-batch adds its own token sum over the same D, the loss and its gradient are the same however
the mini-batch is cut into micro-batches (or, later, ranks): sum_m (S_m / D) = (sum_m S_m) / D.

Terms on this scale (learner/maths/update.py):
- policy gradient: sum_t l_t / D, with l_t the per-token surrogate (grpo.policy_loss);
- entropy bonus: - entropy_coef * sum_t H_t / D, so `entropy_coef` is the weight of one token's entropy
  relative to one token's policy gradient per unit advantage. The authors add 0.001 x the token mean of
  each micro-batch, which against their PG term sum_t l_t / 8192 is 0.001 x 8192 / (tokens per
  micro-batch, about 26k at their 32k-token dynamic micro-batches): about 3e-4 on this scale (and a
  weight that grows with the number of micro-batches, which this object rules out).
The authors divide by ranks x L_max instead of sequences x L_max: the same objective times a constant,
which matters only through the grad-norm clip and skip thresholds (docs/exgrpo.md, "Loss scale").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScale:
    """D = sequences x max_len for one mini-batch; `reduce` turns per-token values into a loss term."""

    sequences: int  # every sequence of the mini-batch, forwarded or not (zero-advantage ones included)
    max_len: int  # L_max, the constant maximum response length

    def __post_init__(self) -> None:
        if self.sequences <= 0 or self.max_len <= 0:
            raise ValueError(f"LossScale needs positive sequences and max_len, got {self.sequences}, {self.max_len}")

    @property
    def denominator(self) -> float:
        return float(self.sequences * self.max_len)

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """sum over the valid tokens of `per_token`, divided by D."""
        return (per_token * mask.to(per_token.dtype)).sum() / self.denominator
