"""Attention within each sequence of a packed row: the kernels the learner's decoder runs on packed micro-batches.

Packed rows (learner/maths/packing.py) hold sequences back to back, position ids restarting at 0 for each. Three
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
learner/maths/grpo.py `check_no_cross_attention` proves at start-up that a packed row's sequences do not see each other.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "varlen", "per_sequence")
_REGISTERED = {"varlen": "exgrpo_varlen", "per_sequence": "exgrpo_per_sequence"}
_TRACEABLE = "_traced"  # the name's suffix for a kernel's traceable variant (`_traceable`)


class Segments(NamedTuple):
    """The sequences of a (R, W) packed layout, flattened to R x W tokens: cumulative boundaries on the
    compute device (int32, for the kernel) and on the host (for loops), and the longest segment (host).

    Tensors only: a compiled decoder layer (learner/maths/compiled.py) passes this through to the kernels here,
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


def use(model: torch.nn.Module, backend: str, traceable: bool = False) -> None:
    """Make `model` (a transformers model) run attention with `backend` (a resolved one); `traceable`: its
    variant with no host reads, which a compiler keeps in the layer's graph (`_traceable`, below)."""
    if backend == "sdpa":
        if traceable:
            raise ValueError("learner.attention='sdpa' with layers compiled under checkpointing: transformers' "
                             "sdpa path builds its packed mask on the host; use 'per_sequence' or 'varlen'")
        model.config._attn_implementation = "sdpa"
        return
    from transformers import AttentionInterface

    for name, fn in (("varlen", varlen_attention), ("per_sequence", per_sequence_attention)):
        AttentionInterface.register(_REGISTERED[name], fn)
        AttentionInterface.register(_REGISTERED[name] + _TRACEABLE, _traceable(name))
    if backend == "varlen":
        _varlen_params()  # here, not inside a compiled layer's trace
    model.config._attn_implementation = _REGISTERED[backend] + (_TRACEABLE if traceable else "")


def wants_segments(model: torch.nn.Module) -> bool:
    """Whether `model` (a transformers model, or the learner's `LogProbs` around one, sharded or not) runs
    one of the kernels here, which need its packed rows' `Segments`."""
    policy = getattr(model, "policy", model)
    impl = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    return impl is not None and impl.removesuffix(_TRACEABLE) in _REGISTERED.values()


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
_VARLEN_ATTN = None  # torch.nn.attention.varlen.varlen_attn, once `_varlen_params` has read it


def _varlen(q, k, v, cu, max_len: int, scale: float | None):
    """`varlen_attn` causal within segments, across the PyTorch releases' two signatures (is_causal in
    2.10, window_size later) and with or without native grouped-query attention."""
    params = _varlen_params()  # no import or inspection here: a compiled layer traces this function
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if scale is not None:
        if "scale" in params:
            kw["scale"] = scale
        elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            raise ValueError("this PyTorch's varlen_attn has no scale argument and the model's is not 1/sqrt(d)")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _VARLEN_ATTN(q, k, v, cu, cu, max_len, max_len, **kw)


def _varlen_params() -> frozenset[str]:
    """`varlen_attn`'s parameter names (read once, eagerly: `use` reads them before anything is compiled)."""
    global _VARLEN_PARAMS, _VARLEN_ATTN
    if _VARLEN_PARAMS is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMS, _VARLEN_ATTN = frozenset(inspect.signature(varlen_attn).parameters), varlen_attn
    return _VARLEN_PARAMS


def _whole_rows(query: torch.Tensor) -> Segments:
    b, _, n, _ = query.shape
    return _segments(list(range(0, b * n + 1, n)), query.device)


@torch.compiler.disable  # learner/maths/compiled.py: the segments must not become guards of a compiled layer
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


# ------------------------------------------------------------------------ the traceable variants
# A layer compiled with its activation checkpoint inside its graph (learner/maths/compiled.py, "under
# checkpointing") cannot break its graph at the attention kernel, as the functions above do (they read
# the segments' boundaries on the host); a compiled layer without checkpointing runs "varlen" in its graph
# too (`attention_in_graph` there). Their traceable variants read nothing on the host:
# - varlen: the same kernel (torch's `varlen_attn` is a custom operator the compiler keeps whole), with the
#   row width as the longest-segment bound (the kernel's grid: blocks past a segment's end do nothing; on
#   an H200 a 16k row's forward and backward took 3% longer so, ops/bench/gpu/gpu_kernels.py);
# - per_sequence: one SDPA call per row with a block-diagonal causal mask built on the device from the
#   segments (the CPU rehearsal's kernel; W^2 work per row, as "sdpa" does).

def _traceable(backend: str):
    """A transformers attention function for `backend` with no host reads (no graph break)."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               packed_segments: Segments | None = None, **_):
        if sliding_window is not None:
            raise ValueError(f"learner.attention={backend!r} does not implement sliding-window layers; use 'sdpa'")
        b, hq, n, d = query.shape
        if packed_segments is None:  # right-padded rows: each row one causal sequence
            cu = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=query.device)
        else:
            cu = packed_segments.cu_seqlens
        if backend == "varlen":  # v: bf16 from its projection under autocast (q and k: fp32 after rotary)
            dt = value.dtype if value.dtype in (torch.bfloat16, torch.float16) else _compute_dtype(query)
            out = _varlen(_flat(query).to(dt), _flat(key).to(dt), _flat(value).to(dt), cu, n, scaling)
            return out.view(b, n, hq, d), None
        token = torch.arange(b * n, dtype=cu.dtype, device=query.device)
        seq = torch.searchsorted(cu[1:], token, right=True).view(b, n)  # each token's segment
        causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        mask = (seq.unsqueeze(-1) == seq.unsqueeze(-2)) & causal  # (B, n, n)
        k, v = key, value
        if k.shape[1] != hq:
            k, v = k.repeat_interleave(hq // k.shape[1], dim=1), v.repeat_interleave(hq // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask.unsqueeze(1), scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    attend.__name__ = f"{backend}_traceable_attention"
    return attend
