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
from typing import Literal

import torch

from learner.buffer import Trajectory
from learner.grpo import pack_sequences, token_logprobs

Selection = Literal["lowest_entropy", "highest_entropy", "random"]


@torch.no_grad()
def score_trajectories(model: torch.nn.Module, prompts: list[list[int]], trajs: list[Trajectory], metric: str,
                       temperature: float, device: torch.device, batch_sequences: int, pad_id: int,
                       bf16: bool = False) -> list[float]:
    """Mean per-token entropy (or NLL) of each trajectory given its prompt, in one pass per batch."""
    scores: list[float] = []
    for i in range(0, len(trajs), batch_sequences):
        p_chunk, t_chunk = prompts[i:i + batch_sequences], trajs[i:i + batch_sequences]
        packed = pack_sequences(p_chunk, [t.token_ids.tolist() for t in t_chunk], pad_id)
        logp, ent = token_logprobs(model, packed["input_ids"].to(device), packed["attention_mask"].to(device),
                                   temperature, with_entropy=True, bf16=bf16)
        mask = packed["target_mask"].to(device).float()
        per_tok = ent if metric == "entropy" else -logp
        scores += ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    return scores


def choose(scores: list[float], mode: Selection, rng: random.Random) -> int:
    if mode == "random":
        return rng.randrange(len(scores))
    best = min if mode == "lowest_entropy" else max
    return best(range(len(scores)), key=scores.__getitem__)


def select_replays(model: torch.nn.Module, questions: list[tuple[int, list[int], list[Trajectory]]], mode: Selection,
                   metric: str, temperature: float, device: torch.device, batch_sequences: int, pad_id: int,
                   rng: random.Random, bf16: bool = False) -> list[tuple[int, Trajectory, float]]:
    """For each (qid, prompt ids, stored trajectories): the chosen trajectory and its score."""
    flat_prompts, flat_trajs, owner = [], [], []
    for qi, (_, prompt, trajs) in enumerate(questions):
        for t in trajs:
            flat_prompts.append(prompt)
            flat_trajs.append(t)
            owner.append(qi)
    if mode == "random":  # the ablation needs no forward pass at all
        scores = [0.0] * len(flat_trajs)
    else:
        scores = score_trajectories(model, flat_prompts, flat_trajs, metric, temperature, device, batch_sequences, pad_id,
                                    bf16)
    out = []
    for qi, (qid, _, trajs) in enumerate(questions):
        idx = [j for j, o in enumerate(owner) if o == qi]
        k = choose([scores[j] for j in idx], mode, rng)
        out.append((qid, trajs[k], scores[idx[k]]))
    return out
