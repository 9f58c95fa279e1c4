"""Learner-side policy: load a Hugging Face causal LM and its tokenizer, save the final model.

The learner trains in fp32 on CPU and in the configured dtype on GPU. Parameters are published to
actors under their Hugging Face names, which vLLM's `load_weights` maps onto its fused layers itself.
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


def save_policy(model, tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
