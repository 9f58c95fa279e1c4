"""The fingerprint of the weights a vLLM worker's model computes with (exgrpo_async/fingerprint.py).

Linear layers (and the LM head) are probed through their own `quant_method.apply`, the path generation
takes: on CPU their weights live only in oneDNN's packed copies (the parameter is empty), and a stale
packed copy is the failure this must catch. Every other parameter is summed as stored. Runs inside the
worker process (`WeightSyncExtension.ws_fingerprint`).

Tensor parallel: each worker fingerprints its share so that the workers' fingerprints, summed block
by block (`combine`), are the whole model's. Bit sums add over disjoint parts, so a column-parallel
layer's or a vocabulary layer's row slice is probed as it is; a row-parallel layer's column slice is
probed at the whole layer's probe columns that fall in it (each plus the bias); a parameter every
worker holds whole (norms, a row-parallel bias) is summed by worker 0 only. Key/value heads copied
onto several workers (fewer KV heads than workers) would be counted twice: such an engine reports no
fingerprint (None), and its loads go unchecked.
"""

from __future__ import annotations

import torch

from actors import vllm_surface
from exgrpo_async.fingerprint import MASK, bitsum, block_of, probe_columns


def _probe_input(cols: list[int], width: int, like: torch.nn.Module) -> torch.Tensor:
    dtype = next((p.dtype for p in like.parameters() if p.is_floating_point()), torch.get_default_dtype())
    x = torch.zeros(len(cols), width, dtype=dtype, device=next(like.parameters()).device)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    return x


@torch.no_grad()
def engine_fingerprint(model: torch.nn.Module) -> dict[str, int] | None:
    """Per block, the bit sum of the probed outputs of this worker's linear layers and of its other
    parameters (its share of them, under tensor parallelism); None if the shares do not add up."""
    LinearBase, ParallelLMHead = vllm_surface.probed_layer_classes()
    Column, Row, Vocab = vllm_surface.sharded_layer_classes()
    rank = next((m.tp_rank for m in model.modules() if isinstance(m, LinearBase)), 0)
    out: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        out[key] = (out.get(key, 0) + value) & MASK

    probed: set[str] = set()
    dtypes: dict[str, torch.dtype] = {}  # each linear layer's weight dtype: its bias is summed in it
    shares: set[str] = set()  # parameters this worker holds a slice of; the others are whole on every worker
    for name, mod in model.named_modules():
        if getattr(mod, "num_kv_head_replicas", 1) > 1:
            return None
        if isinstance(mod, (Column, Vocab)):
            shares |= {f"{name}.{p}" for p, _ in mod.named_parameters(recurse=False)}
        if isinstance(mod, (LinearBase, ParallelLMHead)):
            probed.add(name + ".weight")
            dtypes[name] = mod.weight.dtype
            add(block_of(name + ".weight"), bitsum(_probe(mod, Row, ParallelLMHead)))
    for name, p in model.named_parameters():  # tied weights appear once, under the embedding's name
        if name not in probed and (name in shares or rank == 0):
            add(block_of(name), bitsum(as_published(name, p, dtypes)))
    return out


def as_published(name: str, p: torch.Tensor, linear_dtypes: dict[str, torch.dtype]) -> torch.Tensor:
    """A parameter in the dtype it was published in: a linear layer's bias that vLLM widened to fp32
    for its packed CPU kernel (bf16 weights on AVX-512-BF16/AMX CPUs, `dispatch_cpu_unquantized_gemm`'s
    small-GEMM path) goes back to its weight's dtype, exactly (bf16 -> fp32 -> bf16 is lossless)."""
    owner, _, leaf = name.rpartition(".")
    dtype = linear_dtypes.get(owner)
    if leaf == "bias" and dtype is not None and p.element_size() > dtype.itemsize:
        return p.to(dtype)
    return p


def _probe(mod: torch.nn.Module, Row: type, ParallelLMHead: type) -> torch.Tensor:
    """The layer's outputs for the one-hot probes of exgrpo_async.fingerprint.probe_columns; a
    row-parallel slice answers for the whole layer's probe columns that fall in it (an empty tensor
    if none does), each plus the bias (whole on every worker), as the learner's probe adds it."""
    if isinstance(mod, ParallelLMHead):
        return mod.quant_method.apply(mod, _probe_input(probe_columns(mod.embedding_dim), mod.embedding_dim, mod))
    width, bias = mod.input_size_per_partition, getattr(mod, "bias", None)
    if isinstance(mod, Row) and mod.tp_size > 1:
        start = mod.tp_rank * width
        cols = [c - start for c in probe_columns(mod.input_size) if start <= c < start + width]
        if not cols:
            return torch.zeros(0)
    else:
        cols = probe_columns(width)
    return mod.quant_method.apply(mod, _probe_input(cols, width, mod), bias)


def combine(per_worker: list[dict[str, int] | None]) -> dict[str, int] | None:
    """The engine's fingerprint from its workers' (in any order): their block sums added; None if any
    worker has none."""
    if any(f is None for f in per_worker):
        return None
    out: dict[str, int] = {}
    for f in per_worker:
        for key, value in f.items():
            out[key] = (out.get(key, 0) + value) & MASK
    return out
