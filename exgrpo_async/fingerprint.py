"""Weight fingerprints: proof that an actor's engine computes with the weights it was sent.

A sync can "succeed" and change nothing (a loader that skips a tensor, a pre-packed copy left stale,
a version label on the wrong weights). So after each load the actor fingerprints what its engine
holds, and the learner compares that with the fingerprint of what it published for that version.

A fingerprint is one integer per block (the module path before a parameter's own name, as
`weight_sync.plan_buckets` groups them): the sum, modulo 2**64, of the bit patterns of
- every linear layer's output for a few one-hot inputs (`probe_columns`), run through the layer's
  own compute path (on CPU, the oneDNN-packed weights generation uses; the parameter itself is empty):
  column j of W plus the bias, exactly, and
- every other parameter (embeddings, norms, biases) as stored.
Sums of bit patterns do not depend on order or layout, so the engine's fused projections (q/k/v into
one, gate/up into one) and vocabulary padding (zeros) give the same sums as the learner's separate
tensors. Any changed element changes its block's sum; a tensor that was not loaded leaves it as it was.
"""

from __future__ import annotations

import torch

PROBES = 8  # one-hot input columns per linear layer
MASK = (1 << 64) - 1
CHUNK = 1 << 22  # elements widened to int64 at a time (32 MiB of scratch)


def block_of(name: str) -> str:
    """"model.layers.3.self_attn" for "model.layers.3.self_attn.q_proj.weight" (or for the module
    "model.layers.3.self_attn.qkv_proj" with ".weight" appended)."""
    return name.rsplit(".", 2)[0]


def probe_columns(in_features: int) -> list[int]:
    """The input columns every linear layer is probed at (the same on both sides)."""
    return sorted({(k * in_features) // PROBES for k in range(PROBES)} | {in_features - 1})


def bitsum(t: torch.Tensor, chunk: int = CHUNK) -> int:
    """Sum of the tensor's bit patterns modulo 2**64 (exact, independent of order and shape). Widened
    `chunk` elements at a time, so a large embedding costs no more than 8 x `chunk` bytes of scratch."""
    t = t.detach().contiguous().reshape(-1)
    ints = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    total = 0
    for part in ints.split(chunk):
        wide = part.to(torch.int64)
        if t.element_size() < 8:  # unsigned patterns, so an element's sign bit does not flip the sum's sign
            wide &= (1 << (8 * t.element_size())) - 1
        total += int(wide.sum().item())
    return total & MASK


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    """A weight the engine holds inside a linear layer (probed, not summed): every matrix but embeddings."""
    return t.dim() == 2 and name.endswith(".weight") and "embed" not in name


def expected(named: dict[str, torch.Tensor]) -> dict[str, int]:
    """The fingerprint of published weights (HF names, the actors' dtype). Tied embeddings (no
    lm_head published) are what the engine's lm_head computes with."""
    out: dict[str, int] = {}

    def add(block: str, value: int) -> None:
        out[block] = (out.get(block, 0) + value) & MASK

    for name, t in named.items():
        if is_linear_weight(name, t):
            bias = named.get(name[: -len("weight")] + "bias")
            add(block_of(name), probe_sum(t, bias))
        else:
            add(block_of(name), bitsum(t))
    if "lm_head.weight" not in named:
        embed = next((t for n, t in named.items() if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            add("lm_head", probe_sum(embed, None))
    return out


def probe_sum(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """What a linear layer (out x in `weight`) returns for the one-hot probes, as a bit sum: its
    probed columns plus the bias, rounded to the weights' dtype as the layer's own epilogue does."""
    cols = weight[:, probe_columns(weight.shape[1])].float()
    if bias is not None:
        cols = cols + bias.float()[:, None]
    return bitsum(cols.to(weight.dtype))


def mismatched(got: dict[str, int], want: dict[str, int]) -> list[str]:
    """The blocks whose sums differ, or that one side lacks."""
    return sorted(b for b in set(got) | set(want) if got.get(b) != want.get(b))
