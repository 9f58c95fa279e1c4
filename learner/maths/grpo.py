"""The GRPO maths of the learner: advantages, per-token log-probs and the Dr.GRPO policy loss.

Pure functions over tensors; the loop in train.py decides what goes in. Choices (docs/exgrpo.md, "Loss
scale" and "Code versus paper"):
- advantage A_i = r_i - mean(r of its group), no division by the std (Dr.GRPO);
- per-token ratio r_t = exp(logp_theta - logp_behaviour), the behaviour log-probs being the ones the
  actor sampled with, so stale rollouts are corrected by the same ratio;
- PPO clip max(-A r, -A clip(r, 1-eps, 1+eps)) per token;
- staleness-aware correction (AReaL's decoupled PPO, with verl/slime's truncated IS): with proximal
  log-probs (the learner's policy before this step's update) the clipped ratio is pi_theta/pi_prox and
  each token is weighted by w = pi_prox/pi_behav, truncated at C (w -> min(w, C)) or masked beyond C
  (w -> 0 if w > C), per token or per sequence (w = prod_t of the token ratios). Without proximal
  log-probs the ratio is taken against the behaviour log-probs directly (plain PPO, the baseline);
- aggregation: sum over every valid token of the mini-batch divided by (sequences x L_max), where
  L_max is the constant max response length. No per-sequence or per-token mean, so long and short
  answers weigh by their token count and the scale never depends on the batch's lengths. (The authors'
  code divides by ranks x L_max instead of sequences x L_max: the same objective up to a constant.)
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from learner.maths import compiled
from learner.maths.attention import Segments, segments_from_positions, wants_segments
from learner.maths.packing import to_device
from learner.maths.working_weights import WorkingWeights, working


def group_advantages(rewards: list[float]) -> list[float]:
    """A_i = r_i - mean(r) over one group (no std normalisation)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


class LogProbs(torch.nn.Module):
    """A causal LM as the learner uses it: token ids in, per-token log-probs (and entropies) out.

    One module around the Hugging Face model, so a sharded learner (FSDP2) wraps it as its root unit:
    its forward gathers the root's parameters (embeddings, final norm, output head, tied or not) once,
    and the decoder layers, each their own unit, gather theirs as they run."""

    def __init__(self, policy: torch.nn.Module, compiled_head: bool = False, working: WorkingWeights | None = None):
        super().__init__()
        self.policy = policy
        self.working = working  # bf16 working weights (learner/maths/working_weights.py), cast once per update
        self.compile_head(compiled_head)

    def compile_head(self, on: bool) -> None:
        """The head over one chunk of positions: with autograd checkpointed (its fp32 logits recomputed in
        the backward), without autograd plain; `on`: both compiled (learner/maths/compiled.py), the checkpoint
        inside the graph, so its recompute is that graph's."""
        fns = (_checkpointed_logp_entropy, logp_entropy)
        self.head_grad, self.head_nograd = tuple(compiled.compiled_head(f) for f in fns) if on else fns

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float = 1.0,
                with_entropy: bool = False, chunk_tokens: int | None = None,
                position_ids: torch.Tensor | None = None,
                segments: Segments | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        targets = input_ids[:, 1:]
        model = self.policy
        if self.working is not None:
            self.working.refresh()  # recasts only what an optimizer update (or a load) changed
        decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
        kw = {"position_ids": position_ids} if position_ids is not None else {}
        if segments is not None:  # learner/maths/attention.py's kernels read them
            kw["packed_segments"] = segments
        if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kw).logits[:, :-1]
            logp, entropy = logp_entropy(logits, targets, head_weight=None, head_bias=None, temperature=temperature,
                                          with_entropy=with_entropy)
            return logp, (entropy if with_entropy else None)
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                         **kw).last_hidden_state[:, :-1]
        n, t, h = hidden.shape
        flat_h, flat_t = hidden.reshape(n * t, h), targets.reshape(n * t)
        chunk_tokens = chunk_tokens or logit_chunk(head.out_features, flat_h.device)
        grad = torch.is_grad_enabled() and flat_h.requires_grad
        logps, ents = [], []
        # the head's weight for every chunk (its working copy: one bf16 gradient summed over the chunks,
        # as autocast's one cached cast sums it)
        weight = working(head.weight, self.working.head_copy(head)) if self.working is not None else head.weight
        for a in range(0, n * t, chunk_tokens):
            args = (flat_h[a:a + chunk_tokens], flat_t[a:a + chunk_tokens], weight, head.bias, temperature,
                    with_entropy)
            lp, en = self.head_grad(*args) if grad else self.head_nograd(*args)
            logps.append(lp)
            ents.append(en)
        # fresh tensors, not views of the concatenation (FSDP2 hooks a module's outputs for its backward)
        return torch.cat(logps).reshape(n, t).clone(), (torch.cat(ents).reshape(n, t).clone() if with_entropy else None)


LOGIT_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 logits per chunk, at least MIN_CHUNK_TOKENS positions
MIN_CHUNK_TOKENS = 512
GPU_LOGITS_SHARE = 0.01  # on a GPU, one chunk's fp32 logits take up to this share of the device's memory


def logit_chunk(vocab: int, device: torch.device | None = None) -> int:
    """Positions per chunk of the output head. On CPU: 512 for a real vocabulary (152k: 311 MB of fp32
    logits), more for a small one, whose logits are cheap (the toy's 100 tokens: one chunk of 41,943
    positions; fewer chunks, less per-chunk overhead: 12% of the toy's forward and backward,
    ops/bench/system/learner_pass.py). On a GPU: the largest power of two whose fp32 logits fit 1% of the
    device's memory (1024 positions on an 80 GB H100, 2048 on an H200; a chunk's backward holds about
    4 such copies). Measured on an H200 (docs/benchmarks.md, "GPU check"): 16k positions at 152k vocabulary
    took 241, 223, 214 ms at 512, 1024, 2048 positions per chunk, for 5.3, 6.0, 9.7 GB."""
    if device is not None and device.type == "cuda":
        fit = int(_device_bytes(device) * GPU_LOGITS_SHARE) // (4 * max(1, vocab))
        return max(MIN_CHUNK_TOKENS, 1 << max(0, fit.bit_length() - 1))
    return max(MIN_CHUNK_TOKENS, LOGIT_CHUNK_ELEMENTS // max(1, vocab))


@functools.lru_cache(maxsize=8)
def _device_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int | None = None,
                   bf16: bool = False, position_ids: torch.Tensor | None = None, segments: Segments | None = None):
    """(N, L-1) log-prob of each next token under `model` (a causal LM or its `LogProbs`; logits divided
    by the sampling temperature); with `with_entropy`, also the (N, L-1) entropy of each full
    next-token distribution.

    Memory scales with tokens, not vocabulary x tokens: the decoder's hidden states go through the output
    head `chunk_tokens` positions at a time (default `logit_chunk(vocab)`), each chunk's fp32 logits are reduced to a log-prob and an
    entropy at once, and under autograd each chunk is checkpointed (its logits are recomputed in the
    backward pass instead of kept). A model without the decoder/head split (`.model` and a linear
    `.lm_head`, as Hugging Face causal LMs have) gets the plain full-logits path. With `bf16` the
    forward runs under bf16 autocast (mixed precision; the reductions stay fp32). Packed rows
    (learner/maths/packing.py) pass `position_ids` restarting per sequence and no attention mask, and, for the
    kernels of learner/maths/attention.py, their `segments`."""
    lp = model if isinstance(model, LogProbs) else LogProbs(model)
    args = (input_ids, attention_mask, temperature, with_entropy, chunk_tokens, position_ids, segments)
    if bf16:
        with torch.autocast(device_type=input_ids.device.type, dtype=torch.bfloat16):
            logp, entropy = lp(*args)
    else:
        logp, entropy = lp(*args)
    return (logp, entropy) if with_entropy else logp


def _checkpointed_logp_entropy(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """`logp_entropy` under activation checkpointing (non-reentrant)."""
    return checkpoint(logp_entropy, *args, use_reentrant=False)


def logp_entropy(x: torch.Tensor, targets: torch.Tensor, head_weight: torch.Tensor | None, head_bias, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy (zeros unless `with_entropy`) of the fp32 logits of `x` (hidden
    states through the head, or logits already when `head_weight` is None), at `temperature`."""
    logits = (x if head_weight is None else torch.nn.functional.linear(x, head_weight, head_bias)).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # H = logsumexp(z) - sum p z
    return logp, entropy


def behaviour_weights(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                      cap: float, segments: torch.Tensor | None = None,
                      n_segments: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weight of each token for being sampled by the behaviour policy, not the proximal one.

    mode: "token_truncate" | "token_mask" | "sequence_truncate" | "sequence_mask". A sequence's weight
    is the product of its tokens' ratios; `segments` (R, T) says which sequence each position belongs
    to (packed rows; `n_segments` of them, known to the caller, else read off the tensor), else each row
    is one sequence. Returns the (R, T) detached weights (1 on masked-out positions) and their statistics
    over the valid tokens (or sequences), as 0-d tensors (no host synchronisation): mean and max of the
    raw weight, and the fraction truncated or masked (raw weight above `cap`).
    """
    maskf = mask.float()
    log_w = ((proximal_logp - behaviour_logp) * maskf).detach()
    if mode.startswith("sequence"):
        seg = segments if segments is not None else torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1).expand_as(mask)
        seg = torch.where(mask, seg, torch.zeros_like(seg))
        n_seg = n_segments if n_segments is not None else (int(seg.max()) + 1 if mask.any() else 1)
        flat = seg.reshape(-1)
        sums = torch.zeros(n_seg, dtype=log_w.dtype, device=log_w.device).index_add_(0, flat, log_w.reshape(-1))
        valid = torch.zeros(n_seg, device=log_w.device).index_add_(0, flat, maskf.reshape(-1)) > 0
        stat_raw = torch.exp(sums.clamp(max=80.0))  # clamp: keep exp finite, it is capped anyway
        raw = stat_raw[seg]
    else:
        raw = torch.exp(log_w.clamp(max=80.0))
        stat_raw, valid = raw, mask
    over = raw > cap
    w = torch.clamp(raw, max=cap) if mode.endswith("truncate") else torch.where(over, torch.zeros_like(raw), raw)
    w = torch.where(mask, w, torch.ones_like(w))
    validf = valid.float()
    n = validf.sum()
    some = n > 0
    one = torch.ones((), device=raw.device)
    stats = {"is_weight_mean": torch.where(some, (stat_raw * validf).sum() / n.clamp(min=1), one),
             "is_weight_max": torch.where(some, torch.where(valid, stat_raw, torch.zeros_like(stat_raw)).max(), one),
             "is_truncated_frac": ((stat_raw > cap) & valid).float().sum() / n.clamp(min=1)}
    return w, stats


def mismatch_kl(learner_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over `mask` of the k3 estimate of KL(pi_behav || pi_learner) per token (r - 1 - log r with
    r = pi_learner/pi_behav, unbiased and >= 0 on samples drawn from pi_behav), and the token count (0-d
    tensors: no host synchronisation)."""
    log_r = ((learner_logp - behaviour_logp) * mask.float()).detach()
    k3 = (torch.exp(log_r) - 1.0 - log_r) * mask.float()
    return k3.sum(), mask.sum()


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float | None, normalizer: float, replay_mask: torch.Tensor | None = None,
                shaping_beta: float | None = None, proximal_logp: torch.Tensor | None = None,
                correction: str = "token_truncate", cap: float = 2.0, segments: torch.Tensor | None = None,
                n_segments: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr.GRPO token-sum loss over fresh and (ExGRPO) replayed tokens.

    logp, behaviour_logp, mask, replay_mask: (N, T); advantages: (N,) per row, or (N, T) per token
    (packed rows, whose sequences `segments` names; see `behaviour_weights`). For replayed rows the
    `behaviour_logp` slot holds pi_past, so w = exp(logp - logp_past) is the same formula.
    - fresh tokens: -A * r, PPO-clipped to [1-eps, 1+eps] unless `clip_eps` is None;
    - replayed tokens (`replay_mask`): -A * f(w), f(w) = w / (w + beta) (policy shaping), or f(w) = w
      when `shaping_beta` is None; never clipped.
    - with `proximal_logp` (fresh tokens only): the ratio is against pi_prox and every fresh token's
      term is multiplied by the `correction` weight of pi_prox/pi_behav (see `behaviour_weights`).
    Returns the loss (already divided by `normalizer`) and detached statistics as 0-d tensors, read by
    the caller once per step (no host synchronisation per micro-batch).
    """
    maskf = mask.float()
    fresh = mask if replay_mask is None else mask & ~replay_mask
    freshf = fresh.float()
    anchor = behaviour_logp if proximal_logp is None else torch.where(fresh, proximal_logp, behaviour_logp)
    ratio = torch.exp((logp - anchor) * maskf)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    per_token = -adv * ratio
    n_fresh = freshf.sum()
    clipped_frac = torch.zeros((), device=logp.device)
    if clip_eps is not None:
        clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
        clipped_frac = ((clipped > per_token).float() * freshf).sum() / n_fresh.clamp(min=1)
        per_token = torch.where(fresh, torch.maximum(per_token, clipped), per_token)
    stats: dict[str, torch.Tensor] = {}
    if proximal_logp is not None:
        w, w_stats = behaviour_weights(proximal_logp, behaviour_logp, fresh, correction, cap, segments, n_segments)
        per_token = torch.where(fresh, w * per_token, per_token)
        stats.update(w_stats)
    r = ratio.detach()
    if replay_mask is not None:
        shaped = ratio / (ratio + shaping_beta) if shaping_beta is not None else ratio
        per_token = torch.where(replay_mask, -adv * shaped, per_token)
        rep = (replay_mask & mask).float()
        n_rep = rep.sum()
        stats["replay_w_mean"] = (r * rep).sum() / n_rep.clamp(min=1)
        stats["replay_w_max"] = (r * rep).max()  # 0 without replayed tokens (every ratio is positive)
        stats["replay_tokens"] = n_rep
    loss = (per_token * maskf).sum() / normalizer
    stats.update({
        "ratio_mean": (r * freshf).sum() / n_fresh.clamp(min=1),
        "ratio_max": torch.where(n_fresh > 0, (r * freshf).max(), torch.ones((), device=r.device)),
        "clip_frac": clipped_frac,
        "tokens": maskf.sum(),
    })
    return loss, stats


def rows_logprobs(model: torch.nn.Module, rows, device: torch.device, temperature: float, with_entropy: bool = False,
                  bf16: bool = False):
    """`token_logprobs` over a `learner.maths.packing.Rows` layout."""
    am = to_device(rows.attention_mask, device) if rows.attention_mask is not None else None
    pos = to_device(rows.position_ids, device) if rows.position_ids is not None else None
    seg = (segments_from_positions(rows.position_ids, device)
           if rows.position_ids is not None and wants_segments(model) else None)
    return token_logprobs(model, to_device(rows.input_ids, device), am, temperature, with_entropy, bf16=bf16,
                          position_ids=pos, segments=seg)


@torch.no_grad()
def check_no_cross_attention(forward, vocab: int, device: torch.device, bf16: bool, length: int = 12) -> None:
    """Start-up check: in a packed row of two sequences, the second one's log-probs must not change
    (bit for bit) when the first one's tokens do. Raises if the backend lets sequences see each other."""
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
