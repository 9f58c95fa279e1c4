"""Attention within each sequence of a packed row: the kernels the learner's decoder runs on packed micro-batches.

Packed rows (learner/packing.py) hold sequences back to back, position ids restarting at 0 for each. Three
ways to keep every sequence to itself (`learner.attention`):
- "sdpa": transformers' own path. It finds the sequences from the position ids and builds a block-diagonal
  (R, 1, W, W) mask, so SDPA computes all W^2 pairs of a W-wide row, non-causal, with no flash kernel:
  4 W h FLOPs per token per layer. Cheap on the CPU toy (rows of a few hundred tokens); at W = 16k on a
  GPU about as many FLOPs as the 1.5B model's matrix multiplies (issue 34).
- "varlen": PyTorch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`; CUDA, bf16
  or fp16) over the flattened row with one causal segment per sequence: about 2 L h FLOPs per token, L the
  token's own sequence length.
- "per_sequence": one causal SDPA call per sequence (any device and dtype). The reference the other two
  are tested against on CPU, and the fallback for fp32 compute on a GPU (flash needs 16-bit inputs).
"auto" is "varlen" on a CUDA learner computing in bf16 where the kernel exists, else "sdpa".

The two kernels of ours reach transformers as registered attention functions (`AttentionInterface`),
so the model runs its own layers; the segments travel as the `packed_segments` keyword, which the model
forwards to every attention call (and gradient checkpointing replays). A right-padded row (no
segments) is one causal sequence: its padding comes after every real token, so no real token sees it.
`check_no_cross_attention` proves at start-up that a packed row's sequences do not see each other.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "varlen", "per_sequence")
_REGISTERED = {"varlen": "exgrpo_varlen", "per_sequence": "exgrpo_per_sequence"}


class Segments(NamedTuple):
    """The sequences of a (R, W) packed layout, flattened to R x W tokens: cumulative boundaries on the
    compute device (int32, for the kernel) and on the host (for loops), and the longest segment (host).

    Tensors only: a compiled decoder layer (learner/compiled.py) passes this through to the kernels here,
    and the compiler guards on what it holds; a Python tuple or int would be guarded by value (torch 2.11
    recompiled on every new number of sequences, measured on an H200), a tensor only by its dtype and
    (dynamic) shape. Read `bounds` and `max_len` inside the kernels, never in compiled code."""

    cu_seqlens: torch.Tensor
    host: torch.Tensor
    longest: torch.Tensor

    @property
    def bounds(self) -> tuple[int, ...]:
        return tuple(self.host.tolist())

    @property
    def max_len(self) -> int:
        return int(self.longest)


def _segments(bounds: list[int], device: torch.device) -> Segments:
    host = torch.tensor(bounds, dtype=torch.int32)
    longest = (host[1:] - host[:-1]).max()
    # to a GPU from pinned memory: a copy from pageable memory would wait for the stream
    on_device = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return Segments(on_device, host, longest)


def segments_from_positions(position_ids: torch.Tensor, device: torch.device) -> Segments:
    """Segments of packed rows from their (R, W) position ids (host tensor; every 0 opens a segment,
    the padding at a row's end included). Computed on the host: no device synchronisation."""
    flat = position_ids.reshape(-1).cpu()
    starts = torch.nonzero(flat == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("packed position ids must start every row with 0")
    return _segments(starts + [flat.numel()], device)


def varlen_available(device: torch.device) -> bool:
    """Whether PyTorch's variable-length flash attention can run here (CUDA, a build that has it)."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(setting: str, device: torch.device, bf16: bool) -> str:
    """The backend `learner.attention` means on this device and precision."""
    if setting not in BACKENDS:
        raise ValueError(f"learner.attention={setting!r}: expected one of {BACKENDS}")
    if setting == "auto":
        return "varlen" if bf16 and varlen_available(device) else "sdpa"
    if setting == "varlen" and not varlen_available(device):
        raise ValueError("learner.attention='varlen' needs a CUDA learner and torch.nn.attention.varlen "
                         "(PyTorch 2.10 or later); use 'auto', 'sdpa' or 'per_sequence'")
    if setting == "varlen" and not bf16:
        raise ValueError("learner.attention='varlen' needs bf16 compute (learner.mixed_precision='bf16'): "
                         "flash attention has no fp32 kernel; 'per_sequence' keeps fp32")
    return setting


def use(model: torch.nn.Module, backend: str) -> None:
    """Make `model` (a transformers model) run attention with `backend` (a resolved one)."""
    if backend == "sdpa":
        model.config._attn_implementation = "sdpa"
        return
    from transformers import AttentionInterface

    AttentionInterface.register(_REGISTERED["varlen"], varlen_attention)
    AttentionInterface.register(_REGISTERED["per_sequence"], per_sequence_attention)
    model.config._attn_implementation = _REGISTERED[backend]


def wants_segments(model: torch.nn.Module) -> bool:
    """Whether `model` (a transformers model, or the learner's `LogProbs` around one, sharded or not) runs
    one of the kernels here, which need its packed rows' `Segments`."""
    policy = getattr(model, "policy", model)
    impl = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    return impl in _REGISTERED.values()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B T, H, D)."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h, d)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """16-bit inputs as they are; under autocast (rotary embeddings promote q and k to fp32) its dtype."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.dtype
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    raise ValueError(f"varlen attention needs 16-bit inputs or autocast, got {t.dtype}")


_VARLEN_PARAMS: frozenset[str] | None = None


def _varlen(q, k, v, cu, max_len: int, scale: float | None):
    """`varlen_attn` causal within segments, across the PyTorch releases' two signatures (is_causal in
    2.10, window_size later) and with or without native grouped-query attention."""
    global _VARLEN_PARAMS
    from torch.nn.attention.varlen import varlen_attn

    if _VARLEN_PARAMS is None:
        _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    kw = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
    if scale is not None:
        if "scale" in _VARLEN_PARAMS:
            kw["scale"] = scale
        elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            raise ValueError("this PyTorch's varlen_attn has no scale argument and the model's is not 1/sqrt(d)")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _whole_rows(query: torch.Tensor) -> Segments:
    b, _, n, _ = query.shape
    return _segments(list(range(0, b * n + 1, n)), query.device)


@torch.compiler.disable  # learner/compiled.py: the segments must not become guards of a compiled layer
def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     packed_segments: Segments | None = None, **_):
    """transformers attention function: causal flash attention within each segment (see the module doc)."""
    if sliding_window is not None:
        raise ValueError("learner.attention='varlen' does not implement sliding-window layers; use 'sdpa'")
    seg = packed_segments if packed_segments is not None else _whole_rows(query)
    b, hq, n, d = query.shape
    dt = _compute_dtype(query)
    out = _varlen(_flat(query).to(dt), _flat(key).to(dt), _flat(value).to(dt), seg.cu_seqlens, seg.max_len, scaling)
    return out.view(b, n, hq, d), None


@torch.compiler.disable  # as varlen_attention
def per_sequence_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           sliding_window=None, packed_segments: Segments | None = None, **_):
    """transformers attention function: one causal SDPA call per segment (see the module doc)."""
    if sliding_window is not None:
        raise ValueError("learner.attention='per_sequence' does not implement sliding-window layers; use 'sdpa'")
    seg = packed_segments if packed_segments is not None else _whole_rows(query)
    b, hq, n, d = query.shape
    q, k, v = (_flat(t).transpose(0, 1) for t in (query, key, value))  # (H, B T, D)
    if k.shape[0] != hq:
        k, v = k.repeat_interleave(hq // k.shape[0], dim=0), v.repeat_interleave(hq // v.shape[0], dim=0)
    parts = [F.scaled_dot_product_attention(q[:, a:z], k[:, a:z], v[:, a:z], is_causal=True, scale=scaling)
             for a, z in zip(seg.bounds, seg.bounds[1:])]
    return torch.cat(parts, dim=1).transpose(0, 1).reshape(b, n, hq, d), None


@torch.no_grad()
def check_no_cross_attention(forward, vocab: int, device: torch.device, bf16: bool, length: int = 12) -> None:
    """Start-up check: in a packed row of two sequences, the second one's log-probs must not change
    (bit for bit) when the first one's tokens do. Raises if the backend lets sequences see each other."""
    from learner.grpo import token_logprobs

    g = torch.Generator().manual_seed(0)
    a, b, a2 = (torch.randint(3, max(4, vocab), (length,), generator=g) for _ in range(3))
    pos = torch.cat([torch.arange(length), torch.arange(length)]).unsqueeze(0)
    seg = segments_from_positions(pos, device)
    outs = []
    for first in (a, a2):
        ids = torch.cat([first, b]).unsqueeze(0).to(device)
        outs.append(token_logprobs(forward, ids, None, bf16=bf16, position_ids=pos.to(device), segments=seg)[0, length:])
    if hasattr(forward, "reshard"):
        forward.reshard()
    if not torch.equal(outs[0], outs[1]):
        diff = float((outs[0] - outs[1]).abs().max())
        raise RuntimeError(f"packed rows attend across sequences with this attention backend (a later sequence's "
                           f"log-probs moved by {diff:.3g} when an earlier one changed): this transformers "
                           "release does not detect packed sequences; set learner.attention='per_sequence' or "
                           "upgrade transformers")
