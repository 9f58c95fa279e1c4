"""Attention kernels at the learner's shape: one packed row through each kernel this torch has, forward and
backward, against the one the learner runs (the GPU check's "kernels" section, ops/bench/gpu/gpu_check.py).

The 1.5B step spends 15% of its GPU time in FlashAttention-2 (torch's `varlen_attn`; docs/benchmarks.md,
"Learner MFU"), and the layers compiled under checkpointing run it with the row's width as the longest
segment (learner/maths/attention.py, "traceable variants": the kernel's grid then holds blocks that do
nothing). On one packed row of Qwen2.5-Math-1.5B's attention (12 query heads, 2 key/value heads, 128 wide;
sequences as the GPU check's step draws them) this times, median of several calls:
- "fa2_varlen": the learner's own call (learner/maths/attention.py `_varlen`) with the longest segment;
- "fa2_varlen_row_bound": the same with the row's width as the bound (the traceable variant's call);
- "cudnn_varlen": cuDNN's variable-length kernel (`aten._cudnn_attention_forward/backward` with the
  cumulative lengths; torch's own `varlen_attn` has it switched off), key/value heads repeated (it has no
  grouped-query attention);
- "cudnn_per_sequence", "flash_per_sequence": one dense causal SDPA call per sequence under that backend.
Each: forward ms, forward+backward ms, TFLOP/s of the causal work, and its output and query gradient
against "fa2_varlen"'s (bf16: a few 1e-3 apart is the same attention); a kernel that fails says why.
(The H200 figures of 2026-11-28 took two warm-up calls; the check's `_timed` takes one.)
On CPU (`--tiny`) only "sdpa_per_sequence" runs: the code path, not a timing.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: F401  (the repository importable: learner/ below)

from learner.maths import attention as att


def row_lengths(total: int, prompt: tuple[int, int], completion: tuple[int, int], seed: int) -> list[int]:
    """Sequence lengths (prompt + completion, drawn as the GPU check's step draws them) filling `total`
    tokens, the last one cut to fit."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(*prompt) + rng.randint(*completion), total - sum(out)))
    return out


def causal_flops(lengths: list[int], heads: int, dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention over these sequences: QK^T and PV over the lower
    triangle (2 L^2 d h forward), the backward's five products 2.5 times that."""
    fwd = sum(2.0 * n * n * dim * heads for n in lengths)
    return fwd, 2.5 * fwd


def _per_sequence(q, k, v, bounds: list[int], backend=None) -> torch.Tensor:
    """(T, H, D) inputs: one causal SDPA call per sequence (key/value heads repeated), under `backend`."""
    from torch.nn.attention import sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    parts = []
    for a, z in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:z].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, L, D)
        if backend is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        else:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        parts.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(parts)


class _CudnnVarlen(torch.autograd.Function):
    """cuDNN's variable-length causal attention, forward and backward by its aten operators."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int):
        res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        empty = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(grad.contiguous(), q, k, v, out, lse, seed, offset, empty,
                                                              cu, cu, ctx.max_len, ctx.max_len, 0.0, True)
        return dq, dk, dv, None, None


def _candidates(cuda: bool, bounds: list[int], cu: torch.Tensor, longest: int, width: int) -> dict:
    """name -> attend(q, k, v): (T, Hq, D), (T, Hkv, D) -> (T, Hq, D)."""
    if not cuda:
        return {"sdpa_per_sequence": lambda q, k, v: _per_sequence(q, k, v, bounds)}
    from torch.nn.attention import SDPBackend

    def cudnn(q, k, v):
        rep = q.shape[1] // k.shape[1]
        return _CudnnVarlen.apply(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), cu, longest)

    att._varlen_params()
    return {"fa2_varlen": lambda q, k, v: att._varlen(q, k, v, cu, longest, None),
            "fa2_varlen_row_bound": lambda q, k, v: att._varlen(q, k, v, cu, width, None),
            "cudnn_varlen": cudnn,
            "cudnn_per_sequence": lambda q, k, v: _per_sequence(q, k, v, bounds, SDPBackend.CUDNN_ATTENTION),
            "flash_per_sequence": lambda q, k, v: _per_sequence(q, k, v, bounds, SDPBackend.FLASH_ATTENTION)}


def _measure(ctx, attend, qkv: tuple, grad: torch.Tensor, repeats: int):
    """(forward s, forward+backward s, output, query gradient) of one kernel on fresh leaves of `qkv`."""
    from gpu_check_sections import _timed  # the check's timer (median after a warm-up); imported late: it imports us

    q, k, v = (t.clone().requires_grad_(True) for t in qkv)
    with torch.no_grad():
        t_fwd = _timed(ctx, lambda: attend(q, k, v), repeats)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        attend(q, k, v).backward(grad)

    t_both = _timed(ctx, fwd_bwd, repeats)
    fwd_bwd()
    return t_fwd, t_both, attend(q, k, v).detach().float(), q.grad.float()


def kernels(ctx) -> dict:
    """The section (see the module doc): `ctx` is gpu_check_sections.Context."""
    tiny = ctx.tiny
    heads, kv_heads, dim = (4, 2, 16) if tiny else (12, 2, 128)
    width = 512 if tiny else 16384
    prompt, completion = ((8, 24), (16, 96)) if tiny else ((100, 600), (200, 3072))
    lengths = row_lengths(width, prompt, completion, seed=5)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cu = torch.tensor(bounds, dtype=torch.int32, device=ctx.device)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q0, k0, v0 = (torch.randn(width, h, dim, device=ctx.device, dtype=dtype, generator=g)
                  for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(width, heads, dim, device=ctx.device, dtype=dtype, generator=g)
    fwd_flops, bwd_flops = causal_flops(lengths, heads, dim)
    r: dict = {"row_tokens": width, "sequences": len(lengths), "longest": max(lengths),
               "heads": [heads, kv_heads, dim], "dtype": str(dtype), "causal_gflop_fwd": fwd_flops / 1e9}
    try:
        from torch.nn.attention import list_flash_attention_impls
        r["flash_attention_impls"] = [str(x) for x in list_flash_attention_impls()]
    except (ImportError, RuntimeError) as e:
        r["flash_attention_impls"] = f"unavailable: {type(e).__name__}"
    ref = None
    repeats = 2 if tiny else 7
    for name, attend in _candidates(ctx.cuda, bounds, cu, max(lengths), width).items():
        try:
            t_fwd, t_both, out, dq = _measure(ctx, attend, (q0, k0, v0), grad, repeats)
        except Exception as e:  # noqa: BLE001 (a kernel this torch or GPU lacks: its error is the finding)
            r[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
            continue
        got = {"fwd_ms": t_fwd * 1e3, "fwd_bwd_ms": t_both * 1e3}
        if ctx.cuda:
            got["fwd_tflops"] = fwd_flops / t_fwd / 1e12
            got["fwd_bwd_tflops"] = (fwd_flops + bwd_flops) / t_both / 1e12
        if ref is None:
            ref = (out, dq)
        else:
            got["max_abs_out_vs_first"] = float((out - ref[0]).abs().max())
            got["max_rel_dq_vs_first"] = float((dq - ref[1]).abs().max() / ref[1].abs().max())
        r[name] = got
        ctx.partial("kernels", r)
    return r
