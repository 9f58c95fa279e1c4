"""Learner-side policy: load a Hugging Face causal LM and its tokenizer, its compute context, save it.

The learner keeps fp32 master weights (AdamW at lr 1e-6 rounds away on bf16 weights) and computes in
bf16 under autocast when `learner.mixed_precision="bf16"`. Parameters are published to actors under
their Hugging Face names (cast to the actors' `model.dtype`), which vLLM's `load_weights` maps onto its
fused layers itself; the final model is exported in `model.dtype`.
"""

from __future__ import annotations

from pathlib import Path

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
