"""ExGRPO trajectory selection: which stored trajectory of a question is replayed this step.

For every sampled experience question, all its stored trajectories are scored under the *current*
policy in batched no-grad forward passes (scores are never cached: the policy moved). The default
picks the lowest mean token entropy (the paper's metric, exgrpo-algorithm.md 3.2; the authors' code has
a masking quirk that makes it closer to a total entropy, documented there, not reproduced here).
Ablations: "random" and "highest" entropy; metric "nll" (mean negative log-likelihood, the paper's
Algorithm 1 wording).
"""

from __future__ import annotations

import random
from typing import Callable, Literal

import torch

from learner.buffer import Trajectory
from learner.grpo import pack_sequences, token_logprobs

Selection = Literal["lowest_entropy", "highest_entropy", "random"]


@torch.no_grad()
def score_trajectories(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], metric: str,
                       temperature: float, device: torch.device, batch_sequences: int, pad_id: int,
                       bf16: bool = False, passes: int | None = None,
                       filler: tuple[list[int], list[int]] | None = None) -> list[float]:
    """Mean per-token entropy (or NLL) of each completion given its prompt, in one pass per batch. With
    `passes` (sharded ranks make the same number of forward passes) the passes beyond this rank's own
    work score `filler` and drop it."""
    scores: list[float] = []
    passes = passes if passes is not None else -(-len(completions) // batch_sequences)
    for b in range(passes):
        i = b * batch_sequences
        p_chunk, c_chunk = prompts[i:i + batch_sequences], completions[i:i + batch_sequences]
        if not c_chunk:
            p_chunk, c_chunk = [filler[0]], [filler[1]]
        packed = pack_sequences(p_chunk, [list(c) for c in c_chunk], pad_id)
        logp, ent = token_logprobs(model, packed["input_ids"].to(device), packed["attention_mask"].to(device),
                                   temperature, with_entropy=True, bf16=bf16)
        mask = packed["target_mask"].to(device).float()
        per_tok = ent if metric == "entropy" else -logp
        if i < len(completions):
            scores += ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    return scores


def choose(scores: list[float], mode: Selection, rng: random.Random) -> int:
    if mode == "random":
        return rng.randrange(len(scores))
    best = min if mode == "lowest_entropy" else max
    return best(range(len(scores)), key=scores.__getitem__)


Scorer = Callable[[list[list[int]], list[list[int]], str], list[float]]  # (prompts, completions, metric) -> scores


def select_replays(score: Scorer | None, questions: list[tuple[int, list[int], list[Trajectory]]], mode: Selection,
                   metric: str, rng: random.Random) -> list[tuple[int, Trajectory, float]]:
    """For each (qid, prompt ids, stored trajectories): the chosen trajectory and its score. `score` runs
    the forward passes (learner/policy.py `Policy.score`, over every learner rank)."""
    flat_prompts, flat_comps, owner = [], [], []
    for qi, (_, prompt, trajs) in enumerate(questions):
        for t in trajs:
            flat_prompts.append(list(prompt))
            flat_comps.append(t.token_ids.tolist())
            owner.append(qi)
    if mode == "random":  # the ablation needs no forward pass at all
        scores = [0.0] * len(flat_comps)
    else:
        scores = score(flat_prompts, flat_comps, metric)
    out = []
    for qi, (qid, _, trajs) in enumerate(questions):
        idx = [j for j, o in enumerate(owner) if o == qi]
        k = choose([scores[j] for j in idx], mode, rng)
        out.append((qid, trajs[k], scores[idx[k]]))
    return out
