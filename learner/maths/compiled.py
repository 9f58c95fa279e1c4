"""Compiled regions of the learner's model (`learner.compile`): each decoder layer's body and the output head.

On a GPU the learner's step is mostly memory-bound small kernels, not matrix multiplies (docs/benchmarks.md,
"GPU check": casts, the fp32 residual adds, RMSNorm's upcasts, SiLU, rotary, the head's fp32 logits and
their softmax for log-probs and entropy). `torch.compile` fuses those into few kernels:
- each decoder layer's `forward` is compiled in place (parameter names and FSDP2's hooks stay as they
  are and run eagerly around it; all layers share the graphs, compiled with dynamic shapes, so new row
  widths and sequence counts reuse them, a few shape ranges aside);
- the attention: "varlen" runs its traceable variant inside the layer's graph (`attention_in_graph`: the
  same flash kernel, the segments passed as tensors, so new segment boundaries do not recompile);
  "per_sequence" without checkpointing stays outside the graph (`torch.compiler.disable`: it reads the
  segments' boundaries on the host), its traceable variant only under checkpointing (below);
- the head's per-chunk log-prob and entropy (learner/maths/grpo.py) is compiled with its activation checkpoint
  inside the graph, so the recompute in its backward is part of the same compiled graph.
"auto" on a CUDA learner compiles the head and the layers (checkpointed ones as below, given a traceable
attention backend); on CPU it compiles nothing (minutes of compiling for the toy's seconds of work). "head":
the head alone; "on": both.

The layers under gradient checkpointing: the checkpoint goes inside each layer's graph (torch.compile's own
activation checkpointing: the backward graph recomputes the layer, so the recompute is the forward's own
graph). HF's wrapper, which would checkpoint around the compiled call, is turned off for those layers.
That needs a layer graph without a break, so the attention runs the kernels' traceable variants
(learner/maths/attention.py `use(..., traceable=True)`), and the checkpoint is selective: the attention's
output is saved, everything else recomputed (ops/bench/gpu/gpu_check.py measures the step).
Before (the checkpoint around a compiled layer whose graph broke at the attention kernel), a recompute
picked its graph from the compiler's cache and, on an H200 with torch 2.11, ran another graph than its
forward (CheckpointError: the recomputed saved tensors differed; docs/benchmarks.md, "Compiled regions").
"auto" compiles a checkpointed learner's layers only where `CHECKPOINTED_AUTO` says the compiled step has
been shown to match the eager one (tests/unit/test_compiled.py on CPU; the GPU check on a GPU).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import NamedTuple

import torch

log = logging.getLogger("exgrpo_async.learner")

SETTINGS = ("auto", "on", "head", "off")
# The compiler every region goes through. Inductor always in training; the GPU check's CPU rehearsal
# (ops/bench/gpu/gpu_check.py --compile-backend aot_eager) traces the same regions (Dynamo's graphs, the
# autograd graphs with the checkpoint inside) without Inductor's C++ kernels: a GPU's Triton code cannot be
# rehearsed on a CPU anyway, and Inductor's CPU code for these regions is tests/unit/test_compiled.py's.
BACKEND = "inductor"


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


CHECKPOINTED_AUTO = True  # "auto" compiles checkpointed layers on a GPU: they matched the eager step on CPU
# (tests/unit/test_compiled.py) and on an H200, one rank and FSDP2 (docs/benchmarks.md, issue 51: 5e-4, 8e-4)


def resolve(setting: str, device: torch.device, checkpointing: bool, attention: str = "per_sequence") -> Regions:
    """What `learner.compile` compiles on this device, with or without gradient checkpointing, for the
    resolved `learner.attention` (checkpointed layers need one of learner/maths/attention.py's kernels)."""
    if setting not in SETTINGS:
        raise ValueError(f"learner.compile={setting!r}: expected one of {SETTINGS}")
    traceable = attention != "sdpa"
    if setting == "on" and checkpointing and not traceable:
        raise ValueError("learner.compile='on' with learner.gradient_checkpointing=true and learner.attention="
                         "'sdpa': a checkpointed layer is compiled whole, and transformers' sdpa path builds its "
                         "packed mask on the host; set learner.attention to 'per_sequence' or 'varlen' (or 'auto' "
                         "on a GPU in bf16)")
    auto = setting == "auto" and device.type == "cuda"
    layers_auto = auto and (not checkpointing or (CHECKPOINTED_AUTO and traceable))
    return Regions(layers=setting == "on" or layers_auto, head=setting in ("on", "head") or auto)


def attention_in_graph(regions: Regions, checkpointing: bool, attention: str) -> bool:
    """Whether compiled decoder layers take the attention into their graph (the kernel's traceable variant,
    learner/maths/attention.py `use(..., traceable=True)`): always under checkpointing (the checkpoint sits
    inside the layer's graph); without it for "varlen", whose traceable call is the same kernel (one graph
    per layer instead of two around an eager call: the 1.5B step 2.2% faster on an H200, median of three runs,
    docs/benchmarks.md), not for "per_sequence", whose traceable variant attends over whole rows under a mask
    (W^2 work)."""
    return regions.layers and (checkpointing or attention == "varlen")


def compile_layers(model: torch.nn.Module, checkpointed: bool = False) -> int:
    """Compile the `forward` of each decoder layer of `model` (a transformers causal LM) in place; returns
    how many. `checkpointed`: with the layer's activation checkpoint inside its graph (selective: the
    attention's output saved), HF's checkpointing of the layer turned off; the model must run one of
    learner/maths/attention.py's traceable kernels (`attention.use(..., traceable=True)`). Call before the
    first forward; idempotent."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: learner.compile has no regions to compile")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # an error naming the cause, not a silent eager call
    fixed_cpu_threads()
    for layer in layers:
        if "forward" not in vars(layer):  # the class's forward, bound to this layer, compiled
            fn = functools.partial(_checkpointed, layer.forward) if checkpointed else layer.forward
            layer.forward = torch.compile(fn, dynamic=True, backend=BACKEND)
        if checkpointed:
            layer.gradient_checkpointing = False  # the checkpoint is inside the compiled graph
    return len(layers)


def _save_attention(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep the attention's output, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _attention_ops() -> frozenset:
    """The attention kernels' operators (what `_save_attention` keeps): torch's varlen flash operator and
    the SDPA kernels."""
    aten = torch.ops.aten
    ops = {getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention",
                                              "_scaled_dot_product_efficient_attention",
                                              "_scaled_dot_product_cudnn_attention",
                                              "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, n)}
    try:
        importlib.import_module("torch.nn.attention.varlen")  # registers torch_attn::_varlen_attn
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    return frozenset(ops)


def _checkpointed(forward, *args, **kwargs):
    """A decoder layer's forward under (selective) activation checkpointing, for compiling whole."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _save_attention), **kwargs)


@functools.cache
def compiled_head(fn):
    """`fn` (the head's per-chunk log-prob and entropy) compiled, once per process."""
    fixed_cpu_threads()
    return torch.compile(fn, dynamic=True, backend=BACKEND)


def fixed_cpu_threads() -> None:
    """Compile CPU kernels for a fixed thread count. Inductor's other mode, the count read at run time
    (TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1), corrupted the heap in these regions (torch 2.13 on CPU: "free():
    invalid pointer" and the like within a step, 4 runs in 4). vLLM's CPU platform sets that variable in
    any process that builds an engine, so that process's children inherit it (the test suite's workers
    did: CI's failures of the GPU check's CPU rehearsal)."""
    import torch._inductor.config as inductor

    if inductor.cpp.dynamic_threads:
        log.warning("TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1 ignored: the learner's compiled regions use a fixed "
                    "thread count (learner/maths/compiled.py)")
        inductor.cpp.dynamic_threads = False
