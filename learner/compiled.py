"""Compiled regions of the learner's model (`learner.compile`): each decoder layer's body and the output head.

On a GPU the learner's step is mostly memory-bound small kernels, not matrix multiplies (docs/benchmarks.md,
"GPU check": casts, the fp32 residual adds, RMSNorm's upcasts, SiLU, rotary, the head's fp32 logits and
their softmax for log-probs and entropy). `torch.compile` fuses those into few kernels:
- each decoder layer's `forward` is compiled in place (parameter names and FSDP2's hooks stay as they
  are and run eagerly around it; all layers share the graphs, compiled with dynamic shapes, so new row
  widths and sequence counts reuse them, a few shape ranges aside);
- the attention kernels of learner/attention.py are excluded from the graph (`torch.compiler.disable`):
  the packed segments reach them unseen by the compiler, so new segment boundaries do not recompile;
- the head's per-chunk log-prob and entropy (learner/grpo.py) is compiled with its activation checkpoint
  inside the graph, so the recompute in its backward is part of the same compiled graph.
"auto" on a CUDA learner compiles the head, and the layers too unless they are checkpointed; on CPU it
compiles nothing (minutes of compiling for the toy's seconds of work). "head": the head alone; "on": both.

The layers not with gradient checkpointing: the layer's graph breaks at the attention kernel, so the
checkpoint cannot go inside it as the head's does; a checkpointed layer's recompute must then run the
graph its forward ran, and the compiler picks a graph per call from a cache (the newest whose guards hold). On an H200 with torch
2.11 a recompute ran another graph than its forward and `torch.utils.checkpoint` stopped the step
(CheckpointError: the recomputed saved tensors differed; docs/benchmarks.md, "Compiled regions"). So
"on" with `learner.gradient_checkpointing` is refused and "auto" leaves such a learner's layers eager. The
head is safe either way (its checkpoint is its own graph's), and pays where checkpointing stays: the 1.5B step with gradient
checkpointing on an H200 took 2.61 s with the head alone compiled against 3.01 s eager.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

SETTINGS = ("auto", "on", "head", "off")


class Regions(NamedTuple):
    """What `learner.compile` compiles on this learner."""

    layers: bool
    head: bool

    def __str__(self) -> str:
        return " and ".join(n for n, on in zip(("decoder layers", "head"), self) if on) or "none"


RECOMPILE_LIMIT = 16  # graphs per compiled function: grad and no-grad passes, inputs with and without
# gradients, shape ranges (an H200 run of the 1.5B step: 5 at most). Past the limit torch would run the call
# eagerly, at eager memory (87 GB against 64 GB for the 1.5B step without checkpointing on an H200: an
# out-of-memory error later, far from its cause); `compile_layers` makes it raise there instead.


def resolve(setting: str, device: torch.device, checkpointing: bool) -> Regions:
    """What `learner.compile` compiles on this device, with or without gradient checkpointing."""
    if setting not in SETTINGS:
        raise ValueError(f"learner.compile={setting!r}: expected one of {SETTINGS}")
    if setting == "on" and checkpointing:
        raise ValueError("learner.compile='on' with learner.gradient_checkpointing=true: a checkpointed layer's "
                         "recompute may run another compiled graph than its forward (learner/compiled.py); set "
                         "learner.gradient_checkpointing=false where the memory allows, or learner.compile='auto' "
                         "(the head alone then)")
    auto = setting == "auto" and device.type == "cuda"
    return Regions(layers=setting == "on" or (auto and not checkpointing), head=setting in ("on", "head") or auto)


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the `forward` of each decoder layer of `model` (a transformers causal LM) in place; returns
    how many. Call before the first forward; idempotent."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: learner.compile has no regions to compile")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # an error naming the cause, not a silent eager call
    for layer in layers:
        if "forward" not in vars(layer):  # the class's forward, bound to this layer, compiled
            layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)


@functools.cache
def compiled_head(fn):
    """`fn` (the head's per-chunk log-prob and entropy) compiled, once per process."""
    return torch.compile(fn, dynamic=True)
