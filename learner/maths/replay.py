"""ExGRPO trajectory selection: which stored trajectory of a question is replayed this step.

For every sampled experience question, all its stored trajectories are scored under the *current*
policy in batched no-grad forward passes (scores are never cached: the policy moved). The default
picks the lowest mean token entropy (the paper's metric, section 3.2 of arXiv 2510.02245; the authors' code has
a masking quirk that makes it closer to a total entropy, documented there, not reproduced here).
Ablations: "random" and "highest" entropy; metric "nll" (mean negative log-likelihood, the paper's
Algorithm 1 wording).
"""

from __future__ import annotations

import random
from typing import Callable, Literal

import torch

from learner.maths.buffer import Trajectory
from learner.maths.grpo import rows_logprobs
from learner.maths.packing import layout, micro_batches

Selection = Literal["lowest_entropy", "highest_entropy", "random"]


@torch.no_grad()
def score_trajectories(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], metric: str,
                       temperature: float, device: torch.device, batch_sequences: int, pad_id: int,
                       bf16: bool = False, passes: int | None = None,
                       filler: tuple[list[int], list[int]] | None = None, max_tokens: int | None = None) -> list[float]:
    """Mean per-token entropy (or NLL) of each completion given its prompt, `batch_sequences` per pass
    (or packed under the `max_tokens` budget, as the update's micro-batches). With `passes` (sharded
    ranks make the same number of forward passes) the passes beyond this rank's own work score
    `filler` and drop it."""
    scores: list[float] = []
    parts = micro_batches([len(p) + len(c) for p, c in zip(prompts, completions)], batch_sequences, max_tokens)
    for b in range(passes if passes is not None else len(parts)):
        part = parts[b] if b < len(parts) else []
        ps, cs = ([prompts[i] for i in part], [list(completions[i]) for i in part]) if part else ([filler[0]], [filler[1]])
        rows = layout(ps, cs, pad_id, max_tokens)
        logp, ent = rows_logprobs(model, rows, device, temperature, with_entropy=True, bf16=bf16)
        per_tok = ent if metric == "entropy" else -logp
        if part:
            scores += [float(v.mean()) if len(v) else 0.0 for v in rows.split(per_tok)]
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
