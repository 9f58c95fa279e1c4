"""Learner-side policy: load a Hugging Face causal LM and its tokenizer, its compute context, save it.

The learner keeps fp32 master weights (AdamW at lr 1e-6 rounds away on bf16 weights) and computes in
bf16 under autocast when `learner.mixed_precision="bf16"`. Parameters are published to actors under
their Hugging Face names (cast to the actors' `model.dtype`), which vLLM's `load_weights` maps onto its
fused layers itself; the final model is exported in `model.dtype`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("learner.device='cuda' but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_policy(path: str, dtype: str, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.config.use_cache = False
    return model, tokenizer


def policy_skeleton(path: str):
    """The policy's modules with every parameter on the meta device (no memory; shapes, names and ties
    as loaded) and its buffers real (rotary frequencies are computed, not stored in checkpoints), and its
    tokenizer. A learner rank that is not the lead builds this, shards it, and receives its shards of
    the lead's weights (`materialize`): only rank 0 ever holds the whole model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    return model, AutoTokenizer.from_pretrained(path)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device, their buffers where they are
    (accelerate's `init_empty_weights(include_buffers=False)`, without the dependency). A layer's
    initialisation then runs on meta tensors: no time, no memory."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one may be shared (tied weights): keep it
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a (sharded) skeleton's parameters storage on `device`, keeping its buffers' values; the
    parameters' values are then whatever `set_model_state_dict` brings (uninitialised until then)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    first: dict[int, str] = {}
    ties = []  # (name, name of the parameter it is): tied weights, which to_empty would give storage each
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    model.to_empty(device=device)
    for name, same in ties:
        owner, _, attr = name.rpartition(".")
        if model.get_parameter(name) is not model.get_parameter(same):
            setattr(model.get_submodule(owner), attr, model.get_parameter(same))
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def named_parameters_for_sync(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """HF-named parameters; tied weights appear once (vLLM re-ties lm_head itself)."""
    return [(n, p) for n, p in model.named_parameters()]


def save_policy(model, tokenizer, out_dir: Path, dtype: str | None = None, weights: dict | None = None) -> None:
    """A Hugging Face folder; with `dtype` the weights are written in it (the master weights stay fp32).
    `weights` (a full state dict by parameter name) stands in for the model's own, e.g. gathered from
    a sharded learner; `tokenizer` None writes no tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = weights if weights is not None else model.state_dict()
    target = getattr(torch, dtype) if dtype is not None else None
    if target is not None:
        sd = {k: v.to(target) for k, v in sd.items()}
    model.save_pretrained(str(out_dir), state_dict=sd)
    if dtype is not None and getattr(model.config, "dtype", None) != target:  # the config says what the files hold
        cfg = type(model.config).from_pretrained(str(out_dir))
        cfg.dtype = dtype
        cfg.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
