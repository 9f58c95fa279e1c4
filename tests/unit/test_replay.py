"""Trajectory selection: the lowest mean-entropy trajectory under the current policy wins."""

import random

import numpy as np
import torch

from learner.maths.buffer import Trajectory
from learner.maths.replay import score_trajectories, select_replays


class Bigram(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids]})()


def make_model():
    # token 1 -> very peaked next-token distribution, token 2 -> flat, token 3 -> in between
    t = torch.zeros(6, 6)
    t[1, 4] = 20.0
    t[3, 4] = 2.0
    return Bigram(t)


def scorer(model, batch):
    """Scores with `score_trajectories` on this model, `batch` sequences per pass."""
    return lambda prompts, comps, metric: score_trajectories(model, prompts, comps, metric, 1.0, torch.device("cpu"),
                                                             batch, 0)


def tr(*ids):
    return Trajectory(np.array(ids, np.int32), np.zeros(len(ids), np.float32), 0)


def mean_entropy(model, prompt, ids):
    seq = prompt + ids
    p = torch.softmax(model.table[torch.tensor(seq[len(prompt) - 1:-1])], -1)
    return float((-(p * p.log()).sum(-1)).mean())


def test_lowest_entropy_trajectory_wins_and_highest_for_the_ablation():
    model = make_model()
    prompt = [5]
    trajs = [tr(2, 2, 2), tr(1, 1, 1), tr(3, 3, 1), tr(2, 1)]
    expected = [mean_entropy(model, prompt, t.token_ids.tolist()) for t in trajs]
    rng = random.Random(0)
    score = scorer(model, 2)  # batch of 2: scoring spans several passes
    [(qid, chosen, sc)] = select_replays(score, [(9, prompt, trajs)], "lowest_entropy", "entropy", rng)
    assert qid == 9 and chosen is trajs[int(np.argmin(expected))]
    assert abs(sc - min(expected)) < 1e-5
    [(_, chosen, _)] = select_replays(score, [(9, prompt, trajs)], "highest_entropy", "entropy", rng)
    assert chosen is trajs[int(np.argmax(expected))]


def test_several_questions_are_scored_in_one_batch_and_kept_apart():
    model = make_model()
    q = [(1, [5], [tr(2, 2), tr(1, 1)]), (2, [5], [tr(3, 1)]), (3, [5], [tr(1, 2), tr(2, 2), tr(1, 1, 1)])]
    out = select_replays(scorer(model, 64), q, "lowest_entropy", "entropy", random.Random(0))
    assert [o[0] for o in out] == [1, 2, 3]
    assert out[0][1].token_ids.tolist() == [1, 1] and out[1][1].token_ids.tolist() == [3, 1]
    assert out[2][1].token_ids.tolist() == [1, 1, 1]


def test_random_selection_needs_no_model():
    out = select_replays(None, [(1, [5], [tr(1), tr(2), tr(3)])], "random", "entropy", random.Random(0))
    assert out[0][1].token_ids.tolist()[0] in (1, 2, 3)


def test_padding_passes_score_the_filler_and_drop_it():
    """A sharded rank with less work than the others makes the same number of passes; its scores are its own."""
    model = make_model()
    prompts, comps = [[5], [5]], [[1, 1], [2, 2]]
    plain = score_trajectories(model, prompts, comps, "entropy", 1.0, torch.device("cpu"), 1, 0)
    padded = score_trajectories(model, prompts, comps, "entropy", 1.0, torch.device("cpu"), 1, 0, passes=4,
                                filler=([5], [3, 3]))
    assert padded == plain and len(plain) == 2
