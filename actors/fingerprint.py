"""The fingerprint of the weights a vLLM worker's model computes with (exgrpo_async/fingerprint.py).

Linear layers (and the LM head) are probed through their own `quant_method.apply`, the path generation
takes: on CPU their weights live only in oneDNN's packed copies (the parameter is empty), and a stale
packed copy is the failure this must catch. Every other parameter is summed as stored. Runs inside the
worker process (`WeightSyncExtension.ws_fingerprint`).
"""

from __future__ import annotations

import torch

from actors import vllm_surface
from exgrpo_async.fingerprint import MASK, bitsum, block_of, probe_columns


@torch.no_grad()
def engine_fingerprint(model: torch.nn.Module) -> dict[str, int]:
    """Per block, the bit sum of the probed outputs of its linear layers and of its other parameters."""
    LinearBase, ParallelLMHead = vllm_surface.probed_layer_classes()
    out: dict[str, int] = {}
    probed: set[str] = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, (LinearBase, ParallelLMHead)):
            continue
        width = mod.embedding_dim if isinstance(mod, ParallelLMHead) else mod.input_size_per_partition
        cols = probe_columns(width)
        dtype = next((p.dtype for p in mod.parameters() if p.is_floating_point()), torch.get_default_dtype())
        x = torch.zeros(len(cols), width, dtype=dtype, device=next(mod.parameters()).device)
        x[torch.arange(len(cols)), torch.tensor(cols)] = 1
        if isinstance(mod, ParallelLMHead):
            y = mod.quant_method.apply(mod, x)
        else:
            y = mod.quant_method.apply(mod, x, getattr(mod, "bias", None))
        key = block_of(name + ".weight")
        out[key] = (out.get(key, 0) + bitsum(y)) & MASK
        probed.add(name + ".weight")
    for name, p in model.named_parameters():  # tied weights appear once, under the embedding's name
        if name not in probed:
            key = block_of(name)
            out[key] = (out.get(key, 0) + bitsum(p)) & MASK
    return out
