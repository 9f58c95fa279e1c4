"""The learner's update: the loss does not depend on micro-batching, the entropy bonus sits on the
policy-gradient term's scale, the clip schedule, and fresh versus replayed rewards kept apart."""

import random

import numpy as np
import pytest
import torch

from exgrpo_async.config import RunConfig
from exgrpo_async.config_io import load_config
from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.toy.task import build_model
from learner.dispatch import WorkItem
from learner.maths.batch import Seq, assemble, minibatch_order
from learner.maths.buffer import Trajectory
from learner.maths.grpo import token_logprobs
from learner.maths.packing import pad_rows
from learner.maths.update import StepSettings, update_policy
from learner.train import _clip

L_MAX = 24


def _seqs(n_groups=4, K=4, seed=0, replay=True) -> list[Seq]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(4, 90) for _ in range(rng.randrange(3, 8))]
        rewards = [rng.random() < 0.5 for _ in range(K)]
        mean = sum(rewards) / K
        for j in range(K):
            comp = [rng.randrange(4, 90) for _ in range(rng.randrange(2, L_MAX))] + [2]
            lps = torch.tensor([-rng.uniform(0.5, 4.0) for _ in comp])
            out.append(Seq(prompt, comp, lps, rewards[j] - mean, 0, g, replay and j == 0 and g % 2 == 0, False))
    return out


def _cfg(**learner) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = L_MAX
    for k, v in {"grad_clip": 1e9, "skip_grad_norm": 1e12, "drop_zero_advantage": True, **learner}.items():
        setattr(cfg.learner, k, v)
    cfg.exgrpo.enabled = True
    return cfg


def _run(cfg: RunConfig, seqs: list[Seq], n_groups: int):
    torch.manual_seed(0)
    model = build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # gradients only, the weights stay put
    res = update_policy(model, opt, seqs, n_groups, cfg, StepSettings(clip=0.2), torch.device("cpu"), 0, 0)
    return res, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, model


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_loss_and_gradient_do_not_depend_on_micro_batching(entropy_coef):
    seqs = _seqs()
    ref, ref_grads, _ = _run(_cfg(micro_batch_sequences=64, entropy_coef=entropy_coef), seqs, 4)
    for micro in (1, 3, 5):
        res, grads, _ = _run(_cfg(micro_batch_sequences=micro, entropy_coef=entropy_coef), seqs, 4)
        assert res.losses[0] == pytest.approx(ref.losses[0], rel=1e-5, abs=1e-8)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7)
    assert ref.norms[0] > 0


def test_entropy_bonus_is_a_token_sum_over_the_policy_gradient_denominator():
    seqs = _seqs(replay=False)
    for s in seqs:
        s.advantage = 0.0  # only the entropy term is left
    coef = 0.05
    res, _, model = _run(_cfg(micro_batch_sequences=5, entropy_coef=coef), seqs, 4)
    rows = pad_rows([s.prompt for s in seqs], [s.completion for s in seqs], 0)
    with torch.no_grad():
        _, ent = token_logprobs(model, rows.input_ids, rows.attention_mask, 1.0, with_entropy=True)
    expected = -coef * float((ent * rows.target_mask).sum()) / (len(seqs) * L_MAX)
    assert res.losses[0] == pytest.approx(expected, rel=1e-5)


def test_zero_advantage_sequences_are_skipped_only_without_the_entropy_bonus():
    seqs = _seqs(replay=False)
    res0, _, _ = _run(_cfg(entropy_coef=0.0), seqs, 4)
    res1, _, _ = _run(_cfg(entropy_coef=1e-3), seqs, 4)
    live = sum(1 for s in seqs if s.advantage != 0)
    assert res0.stats[0]["tokens"] == sum(len(s.completion) for s in seqs if s.advantage != 0)
    assert res1.stats[0]["tokens"] == sum(len(s.completion) for s in seqs)
    assert 0 < live < len(seqs)


def test_clip_schedule_follows_the_switch_in_both_arms():
    cfg = load_config(None, ["learner.clip_eps=0.2"])
    assert cfg.learner.clip_schedule == "until_start"
    assert _clip(cfg, started=False) == 0.2 and _clip(cfg, started=True) is None
    cfg = load_config(None, ["learner.clip_schedule=always"])
    assert _clip(cfg, started=True) == 0.2
    cfg = load_config(None, ["learner.clip_eps=0"])
    assert _clip(cfg, started=False) is None


def test_moved_exgrpo_loss_keys_name_their_replacements():
    with pytest.raises(ValueError, match="learner.entropy_coef"):
        load_config(None, ["exgrpo.entropy_coef=0.001"])
    with pytest.raises(ValueError, match="learner.clip_schedule"):
        load_config(None, ["exgrpo.clip_after_switch=true"])


def _group(qid, rewards, version=3):
    comps = [Completion(np.array([5, 6, 2], np.int32), np.array([-0.1, -0.2, -0.3], np.float32), float(r), "stop", "ok")
             for r in rewards]
    return RolloutGroup(work_id=qid, question_id=qid, prompt_ids=np.array([1, 7], np.int32), completions=comps,
                        policy_version=version, actor_id="a", extra={"replay_reward": 1.0})


def test_assemble_keeps_fresh_and_replayed_rewards_apart():
    traj = Trajectory(np.array([5, 2], np.int32), np.array([-0.5, -0.1], np.float32), version=1)
    fresh = (WorkItem(1, 10, 4, "train", 1.0), _group(10, [0, 0, 0, 0]))
    exp = (WorkItem(2, 11, 3, "train", 1.0, replay=traj), _group(11, [0, 0, 1]))
    b = assemble([fresh, exp], version=4, collecting=True)
    assert b.fresh_rewards == [0, 0, 0, 0, 0, 0, 1] and b.replay_rewards == [1.0]
    assert [g.k for g in b.groups] == [0, 2] and b.groups[1].replay is traj
    assert b.fresh_tokens == 7 * 3  # replayed tokens are not generated work
    replayed = [s for s in b.seqs if s.replay]
    assert len(replayed) == 1 and replayed[0].advantage == pytest.approx(1 - 2 / 4)
    assert [s.collect for s in b.seqs if s.group == 1] == [False, False, False, True]


def test_minibatches_draw_groups_at_random_not_in_dispatch_order():
    # experience items are dispatched first (lowest work ids): in dispatch order all 8 would sit in the
    # first of two mini-batches of 16 groups
    traj = Trajectory(np.array([5, 2], np.int32), np.array([-0.5, -0.1], np.float32), version=1)
    batch = [(WorkItem(i, i, 4, "train", 1.0, replay=traj if i < 8 else None), _group(i, [0, 1, 0, 0])) for i in range(16)]
    rng = random.Random(0)
    first_half = [sum(1 for it, _ in minibatch_order(list(reversed(batch)), rng)[:8] if it.replay is not None)
                  for _ in range(400)]
    assert abs(sum(first_half) / len(first_half) - 4.0) < 0.3  # 8 of 16 spread evenly: 4 expected
    assert minibatch_order(batch, random.Random(5)) == minibatch_order(list(reversed(batch)), random.Random(5))


def _moved_fraction(model_dtype: torch.dtype, mixed_precision: str) -> float:
    seqs = _seqs(replay=False)
    torch.manual_seed(0)
    model = build_model(0).to(model_dtype)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    cfg = _cfg(mixed_precision=mixed_precision, lr=1e-6)
    update_policy(model, opt, seqs, 4, cfg, StepSettings(clip=0.2), torch.device("cpu"), 0, 0)
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
    touched = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    return moved / touched


def test_fp32_master_weights_move_at_lr_1e6_with_bf16_compute():
    assert _moved_fraction(torch.float32, "bf16") >= 0.99
    # bf16 master weights (the old GPU path): most AdamW steps of ~1e-6 round away
    assert _moved_fraction(torch.bfloat16, "none") < 0.5


def test_gradient_checkpointing_gives_the_same_gradient():
    seqs = _seqs()
    cfg = _cfg(micro_batch_sequences=5)
    ref, ref_grads, _ = _run(cfg, seqs, 4)
    torch.manual_seed(0)
    model = build_model(0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert model.model.gradient_checkpointing
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    res = update_policy(model, opt, seqs, 4, cfg, StepSettings(clip=0.2), torch.device("cpu"), 0, 0)
    assert res.losses[0] == pytest.approx(ref.losses[0], rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-7)


def test_phase_seconds_account_for_the_update_and_the_recompute():
    """Each phase's time is recorded: the forward and backward of every micro-batch, the pre-update
    recompute of the second mini-batch's sequences, the optimizer updates; together within the wall time."""
    import time

    cfg = _cfg(micro_batch_sequences=3, minibatches_per_step=2)
    t0 = time.perf_counter()
    res, _, _ = _run(cfg, _seqs(), 4)
    wall = time.perf_counter() - t0
    assert set(res.seconds) == {"recompute", "forward", "backward", "optimizer"}
    assert all(v > 0 for v in res.seconds.values()), res.seconds
    assert sum(res.seconds.values()) < wall and not res.events
