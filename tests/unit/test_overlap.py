"""The update fed group by group (learner/overlap.py): micro-batches computed while the batch arrives
give the whole-batch update's loss, gradient and pi_past; a group of the wrong size cannot slip past
the fixed loss scale; the NaN drill still fires."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from exgrpo_async.config import RunConfig
from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.toy.task import build_model
from learner.dispatch import WorkItem
from learner.maths.batch import assemble
from learner.maths.buffer import Trajectory
from learner.maths.update import StepSettings, update_policy
from learner.overlap import Accumulator
from learner.ranks import Ranks

K, B, L_MAX, VERSION = 4, 6, 20, 5


def _arrivals(seed: int = 0) -> list[tuple[WorkItem, RolloutGroup]]:
    """B groups of K: fresh ones, experience ones (a replayed trajectory and K-1 fresh), one all wrong
    (zero advantages), at staleness 0 or 1."""
    rng = random.Random(seed)
    out = []
    for q in range(B):
        def ids(n):
            return np.array([rng.randrange(4, 90) for _ in range(n)] + [2], np.int32)

        replay = None
        if q % 3 == 1:
            r_ids = ids(rng.randrange(2, L_MAX - 1))
            replay = Trajectory(r_ids, np.array([-rng.uniform(0.2, 2.0) for _ in r_ids], np.float32), version=1)
        n = K - 1 if replay is not None else K
        rewards = [0.0] * n if q == 4 else [float(rng.random() < 0.5) for _ in range(n)]
        comps = []
        for r in rewards:
            c = ids(rng.randrange(2, L_MAX - 1))
            comps.append(Completion(c, np.array([-rng.uniform(0.2, 3.0) for _ in c], np.float32), r, "stop", "ok"))
        prompt = np.array([1] + [rng.randrange(4, 90) for _ in range(rng.randrange(3, 8))], np.int32)
        g = RolloutGroup(work_id=q, question_id=q, prompt_ids=prompt, completions=comps,
                         policy_version=VERSION - (q % 2), actor_id="a", extra={"replay_reward": 1.0})
        out.append((WorkItem(q, q, n, "train", 1.0, replay=replay), g))
    return out


def _cfg(**learner) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.rollout.samples_per_question = L_MAX, K
    cfg.learner.questions_per_step = B
    for k, v in {"grad_clip": 1e9, "skip_grad_norm": 1e12, **learner}.items():
        setattr(cfg.learner, k, v)
    cfg.exgrpo.enabled, cfg.exgrpo.pi_past = True, "learner"
    return cfg


def _policy(cfg: RunConfig) -> SimpleNamespace:
    """What the Accumulator uses of learner.policy.Policy on one rank (a real model and optimizer)."""
    torch.manual_seed(0)
    model = build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # gradients only, the weights stay put
    return SimpleNamespace(cfg=cfg, ranks=Ranks(), model=model, forward=model, opt=opt, device=torch.device("cpu"),
                           pad_id=0)


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_micro_batches_run_as_groups_arrive_and_give_the_whole_batch_update(entropy_coef):
    arrivals = _arrivals()
    ref_cfg = _cfg(micro_batch_sequences=64, entropy_coef=entropy_coef)
    ref_p = _policy(ref_cfg)
    batch = assemble(arrivals, VERSION, collecting=True)
    ref = update_policy(ref_p.forward, ref_p.opt, batch.seqs, B, ref_cfg, StepSettings(clip=0.2),
                        torch.device("cpu"), 0, 0)
    assert any(s.collect for s in batch.seqs) and any(s.replay for s in batch.seqs)

    cfg = _cfg(micro_batch_sequences=3, entropy_coef=entropy_coef)
    p = _policy(cfg)
    acc = Accumulator(p, StepSettings(clip=0.2), VERSION, collecting=True, n_groups=B)
    for item, g in arrivals:
        acc.add(item, g)
    early = acc.micro_batches
    assert early > 0 and acc.busy > 0, "no micro-batch ran before the batch was complete"
    got, res = acc.finish(0)
    assert acc.micro_batches > early and not p.model.training

    assert [s.completion for s in got.seqs] == [s.completion for s in batch.seqs]
    assert res.losses[0] == pytest.approx(ref.losses[0], rel=1e-5, abs=1e-8)
    assert res.norms[0] == pytest.approx(ref.norms[0], rel=1e-4) and ref.norms[0] > 0
    for name, g in _grads(ref_p.model).items():
        torch.testing.assert_close(_grads(p.model)[name], g, rtol=1e-4, atol=1e-7)
    assert res.pi_past.keys() == ref.pi_past.keys() and res.pi_past
    for i, v in ref.pi_past.items():
        torch.testing.assert_close(res.pi_past[i], v, rtol=1e-5, atol=1e-6)
    assert sum(st["tokens"] for st in res.stats) == sum(st["tokens"] for st in ref.stats)
    assert res.diff_max == pytest.approx(ref.diff_max, rel=1e-5)


def test_a_group_of_the_wrong_size_cannot_pass_the_fixed_loss_scale():
    arrivals = _arrivals()
    item, g = arrivals[0]
    g.completions = g.completions[:-1]  # the server re-issues such a group; here it got through
    acc = Accumulator(_policy(_cfg()), StepSettings(clip=0.2), VERSION, collecting=False, n_groups=B)
    for it, gr in arrivals:
        acc.add(it, gr)
    with pytest.raises(RuntimeError, match="loss scale"):
        acc.finish(0)


def test_the_nan_drill_fires_on_an_all_zero_batch_and_skips_the_update():
    arrivals = _arrivals()
    for _, g in arrivals:
        for c in g.completions:
            c.reward = 1.0
    p = _policy(_cfg())
    acc = Accumulator(p, StepSettings(clip=0.2, nan_drill=True), VERSION, collecting=False, n_groups=B)
    for it, g in arrivals:
        acc.add(it, g)
    _, res = acc.finish(0)
    assert acc.micro_batches == 1 and res.skipped == 1 and res.updates == 0


def test_several_ranks_or_minibatches_take_the_whole_batch_path():
    with pytest.raises(ValueError, match="one mini-batch"):
        Accumulator(_policy(_cfg(minibatches_per_step=2)), StepSettings(clip=0.2), VERSION, False, B)
