"""bf16 working weights: the fp32 master weights cast for the matmuls once per optimizer update.

Under bf16 autocast every matmul casts its fp32 weight to bf16, and autocast keeps a cast only for one
autocast region: each micro-batch's forward casts every weight again, a checkpointed layer's recompute
in the backward casts it once more, and the head's checkpointed chunks cast the head's weight once per
chunk in the backward. `WorkingWeights` keeps one bf16 copy of each weight the matmuls use (every
linear layer of the decoder layers, and the output head), made when its master changes (the master's
version counter moved: an optimizer update, a checkpoint load) and read by every forward, recompute and
chunk until then.

The numerics are autocast's: a working weight is the master rounded to bf16 as autocast rounds it, and
its gradient reaches the master as autocast's cast sends it (the bf16 gradient cast to fp32, then summed
in fp32 over micro-batches; the head's chunks share one copy, as they share autocast's one cached cast), so a step takes the same loss and gradient with or without
working weights (tests/unit/test_working_weights.py: bit for bit). fp32 masters and AdamW state are
unchanged: the optimizer updates the masters, and the next forward recasts them.

The unsharded learner's way. A sharded learner (learner/policy.py `shard`) gets its layers' bf16 weights
from FSDP2's mixed-precision policy instead (gathered in bf16 per layer, gradients reduced in fp32).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _Working(torch.autograd.Function):
    """`working` (the master in bf16) in the forward; the gradient to `master`, cast to its dtype."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, working: torch.Tensor) -> torch.Tensor:
        ctx.dtype = master.dtype
        return working.view_as(working)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def working(master: torch.Tensor, copy: torch.Tensor | None) -> torch.Tensor:
    """The weight a matmul should use: the working copy wired to its master, or the master itself."""
    return master if copy is None else _Working.apply(master, copy)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, _Working.apply(self.weight, self.working_weight), self.bias)


class WorkingWeights:
    """The bf16 working copies of one model's matmul weights (see the module doc)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no .model.layers: no working weights to make")
        self.modules = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        head = getattr(model, "lm_head", None)
        if isinstance(head, torch.nn.Linear):
            self.modules.append(head)
        self.dtype, self.casts = dtype, 0
        self._seen: list[tuple[int, int]] = [(-1, -1)] * len(self.modules)
        for m in self.modules:
            m.register_buffer("working_weight", torch.empty_like(m.weight, dtype=dtype), persistent=False)
            if m is not head:  # the head's chunks take theirs from `head_weight` (learner/maths/grpo.py)
                m.forward = types.MethodType(_linear_forward, m)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> int:
        """Recast every weight whose master changed since its last cast; returns how many were."""
        n = 0
        for i, m in enumerate(self.modules):
            key = (id(m.weight), m.weight._version)
            if key != self._seen[i]:
                m.working_weight.copy_(m.weight)
                self._seen[i] = key
                n += 1
        self.casts += n
        return n

    def remove(self) -> None:
        """Put the modules back as they were (their own forward, no working copy): autocast's casts again."""
        for m in self.modules:
            vars(m).pop("forward", None)
            del m.working_weight

    def head_copy(self, head: torch.nn.Module) -> torch.Tensor | None:
        """The output head's working copy (None when the head has none)."""
        return getattr(head, "working_weight", None) if head in self.modules else None
