"""A memory model of one learner rank: how many GPUs a model needs at a given micro-batch token budget.

Per rank, in bytes (P parameters, world ranks, T tokens per micro-batch, h width, f MLP width, kv the
key/value width, V vocabulary, n layers, c the head's chunk of positions, b the compute dtype's bytes):
- sharded state (FSDP2, fp32 master weights, fp32 gradients, AdamW's two fp32 moments): 16 P / world;
- gathered parameters while they run: the root unit (embeddings and head, in fp32) for the whole
  forward/backward and two decoder layers at a time (one running, one prefetched; compute dtype),
  plus the unsharded fp32 gradients before their reduce-scatter;
- activations, with gradient checkpointing: each layer's input kept (n T h b), one layer's internals
  recomputed in its backward (T A b with A = ACT_PER_LAYER(h, f, kv) values per token), the final
  hidden states (T h 4), and the output head on c positions at a time: HEAD_COPIES fp32 [c, V] tensors
  (logits, their exponent / softmax, the product for the entropy, the gradient);
- without checkpointing and chunking (the learner before issue 15): every layer's internals for all T
  tokens (n T A b) and HEAD_COPIES_FULL fp32 [T, V] tensors.
`step_peak_bytes` is the part a step adds above the master weights and optimizer state on one unsharded
rank (what ops/bench/system/learner_memory.py measures on CPU: gradients plus activations); `rank_bytes` adds
the state and the gathered parameters, for a GPU plan, and `lead_bytes` the lead's publish buffers (docs/memory.md has the derivation, the
measurements it was checked against, and the plans for the 1.5B and 7B configs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HEAD_COPIES = 4  # fp32 [c, V] tensors alive at once in a checkpointed head chunk's backward (measured: 4.0)
HEAD_COPIES_FULL = 5  # the same over all T positions on the old path (measured: 4.3-4.8)
ALLOCATOR_SLACK = 1.10  # caching allocator fragmentation on a GPU
CUDA_CONTEXT = 1 << 30  # CUDA context, NCCL buffers, kernels


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def kv(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def params(self, layers: int | None = None) -> int:
        n = self.layers if layers is None else layers
        h, f, kv = self.hidden, self.intermediate, self.kv
        layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h  # qkv (+bias), o, mlp, norms
        return n * layer + self.vocab * h * (1 if self.tied else 2) + h


QWEN25_05B = Shape("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True)
QWEN25_15B = Shape("Qwen2.5-Math-1.5B", 1536, 8960, 28, 12, 2, 151936, True)
QWEN25_7B = Shape("Qwen2.5-Math-7B", 3584, 18944, 28, 28, 4, 152064, False)
LLAMA31_8B = Shape("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, False)


def qwen2_config(s: Shape, layers: int | None = None, max_positions: int = 8192):
    """A transformers Qwen2Config of this shape, for random-weight benchmarks (ops/bench)."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers if layers is None else layers, num_attention_heads=s.heads,
                       num_key_value_heads=s.kv_heads, vocab_size=s.vocab, tie_word_embeddings=s.tied,
                       max_position_embeddings=max_positions, attn_implementation="sdpa", use_cache=False)


def act_per_layer(s: Shape) -> int:
    """Values per token a decoder layer keeps for its backward: norms, q/k/v, attention output and its
    projection, residuals (about 10 h), the MLP's gate, up, activation and product (4 f), rope'd k/v."""
    return 10 * s.hidden + 4 * s.intermediate + 2 * s.kv


def step_peak_bytes(s: Shape, tokens: int, layers: int | None = None, path: str = "new", chunk: int = 512,
                    compute_bytes: int = 4) -> int:
    """Gradients plus activations of one step on one unsharded rank (above weights and AdamW state)."""
    n = s.layers if layers is None else layers
    grads = 4 * s.params(n)
    if path == "old":
        return grads + n * tokens * act_per_layer(s) * compute_bytes + HEAD_COPIES_FULL * tokens * s.vocab * 4
    boundaries = n * tokens * s.hidden * compute_bytes + tokens * s.hidden * 4
    one_layer = tokens * act_per_layer(s) * compute_bytes
    head = HEAD_COPIES * min(chunk, tokens) * s.vocab * 4
    return grads + boundaries + one_layer + head


def rank_bytes(s: Shape, tokens: int, world: int, compute_bytes: int = 2, chunk: int = 512,
               sharded: bool | None = None) -> int:
    """Peak memory of one learner GPU: sharded state, gathered parameters, activations, overheads.
    `sharded` (default: world > 1): the model under FSDP2, as on several ranks (the GPU check runs FSDP2
    on one); else one plain rank."""
    p = s.params()
    root = s.vocab * s.hidden * (1 if s.tied else 2)
    layer = (p - root) // s.layers
    state = 16 * p / world
    # the root (embeddings, head) gathered in fp32 (learner/policy.py `shard`), two layers in compute dtype,
    # and their fp32 gradients unsharded; one unsharded rank gathers nothing, but keeps a working copy of
    # its layers' and head's weights in a 16-bit compute dtype (learner/maths/working_weights.py)
    gathered = 4 * root + 2 * layer * compute_bytes + 4 * root + 4 * 2 * layer
    if not (world > 1 if sharded is None else sharded) and compute_bytes == 2:
        gathered = compute_bytes * (layer * s.layers + s.vocab * s.hidden)
    acts = step_peak_bytes(s, tokens, path="new", chunk=chunk, compute_bytes=compute_bytes) - 4 * s.params()
    return int((state + gathered + acts) * ALLOCATOR_SLACK + CUDA_CONTEXT)


H100_80GB_BYTES = 85_520_809_984  # torch.cuda.get_device_properties(...).total_memory of an H100 80GB


def lead_bytes(s: Shape, tokens: int, world: int, publish_sets: int = 1, sync_dtype_bytes: int = 2,
               compute_bytes: int = 2) -> int:
    """Peak memory of the lead learner rank: a rank's, plus the packed weights it keeps for sending
    (`weight_sync.publish_sets` copies of the model in the actors' dtype, exgrpo_async/weight_sync.py)."""
    return rank_bytes(s, tokens, world, compute_bytes) + publish_sets * s.params() * sync_dtype_bytes


def gpus_needed(s: Shape, tokens: int, gpu_bytes: int = 80 * 10**9, max_world: int = 64) -> int | None:
    """The fewest learner GPUs (a power of two) whose ranks each fit `gpu_bytes` at `tokens` per micro-batch."""
    for k in range(int(math.log2(max_world)) + 1):
        if rank_bytes(s, tokens, 2 ** k) <= gpu_bytes:
            return 2 ** k
    return None
