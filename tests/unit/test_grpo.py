"""GRPO maths: advantages, log-probs, and the Dr.GRPO PPO loss."""

import math

import torch

from learner.maths.grpo import group_advantages, policy_loss, token_logprobs


def test_advantages_are_reward_minus_group_mean_without_std():
    assert group_advantages([1, 0, 0, 1]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1, 0, 0, 0]) == [0.75, -0.25, -0.25, -0.25]  # std division would give 1.5 / -0.5
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]
    assert group_advantages([]) == []


class Bigram(torch.nn.Module):
    """A fake LM whose next-token logits depend only on the current token."""

    def __init__(self, vocab=11):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_token_logprobs_match_log_softmax_and_temperature():
    torch.manual_seed(0)
    m = Bigram()
    ids = torch.tensor([[1, 4, 2, 7]])
    lp = token_logprobs(m, ids, torch.ones_like(ids), temperature=0.5)
    ref = torch.log_softmax(m.table[ids[0, :-1]] / 0.5, -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(lp[0], ref)


def test_on_policy_loss_gradient_is_reinforce_over_constant_normalizer():
    torch.manual_seed(0)
    logp = torch.randn(2, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.5, -0.25])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, clip_eps=0.2, normalizer=2 * 64.0)
    loss.backward()
    expected = -(adv[:, None] * mask.float()) / (2 * 64.0)  # d/dlogp of -A * exp(logp - logp_old) at ratio 1
    torch.testing.assert_close(logp.grad, expected)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-6 and stats["clip_frac"] == 0.0


def test_clipping_stops_the_gradient_outside_the_trust_region():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()  # ratios 1.5, 0.5, 1.1
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2, normalizer=1.0)
    loss.backward()
    # positive advantage: ratio 1.5 > 1.2 is clipped (no grad); 0.5 and 1.1 keep -A * ratio
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, -1.1]]))
    assert abs(stats["clip_frac"] - 1 / 3) < 1e-6
    logp.grad = None
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=None, normalizer=1.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -0.5, -1.1]]))


def test_masked_tokens_contribute_nothing():
    logp = torch.randn(1, 4, requires_grad=True)
    behav = torch.randn(1, 4)
    behav_garbage = behav.clone()
    behav_garbage[0, 3] = 1e4  # would overflow exp() if it were not masked
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    a, _ = policy_loss(logp, behav, torch.tensor([1.0]), mask, 0.2, 8.0)
    b, _ = policy_loss(logp, behav_garbage, torch.tensor([1.0]), mask, 0.2, 8.0)
    assert torch.isfinite(b) and torch.allclose(a, b)


def test_policy_shaping_gradient_is_beta_w_over_w_plus_beta_squared():
    beta = 0.1
    past = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    logp = torch.log(torch.tensor([[0.3, 0.6, 0.9]])).requires_grad_()
    mask = torch.ones(1, 3, dtype=torch.bool)
    A = torch.tensor([0.75])
    loss, stats = policy_loss(logp, past, A, mask, clip_eps=0.2, normalizer=1.0, replay_mask=mask, shaping_beta=beta)
    loss.backward()
    w = torch.exp(logp.detach() - past)
    torch.testing.assert_close(logp.grad, -A * beta * w / (w + beta) ** 2)  # f'(w) * w = beta w / (w+beta)^2
    assert stats["clip_frac"] == 0.0 and abs(stats["replay_w_max"] - float(w.max())) < 1e-6  # replay is never clipped


def test_fresh_and_replayed_tokens_are_weighted_as_the_spec_says():
    past_or_behav = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[2.0, 2.0], [2.0, 2.0]])).requires_grad_()  # every ratio is 2
    mask = torch.ones(2, 2, dtype=torch.bool)
    replay = torch.tensor([[True, True], [False, False]])  # row 0 replayed, row 1 fresh
    A = torch.tensor([1.0, 1.0])
    loss, _ = policy_loss(logp, past_or_behav, A, mask, clip_eps=0.2, normalizer=4.0, replay_mask=replay, shaping_beta=0.1)
    # replayed: -f(2) = -2/2.1 per token, unclipped; fresh: clipped at 1.2 for A > 0
    expected = (2 * (-2 / 2.1) + 2 * (-1.2)) / 4.0
    assert abs(float(loss) - expected) < 1e-6
    loss, _ = policy_loss(logp, past_or_behav, A, mask, clip_eps=None, normalizer=4.0, replay_mask=replay, shaping_beta=None)
    assert abs(float(loss) - (4 * -2.0) / 4.0) < 1e-6  # no shaping, no clip: plain ratios


def test_entropy_matches_definition():
    torch.manual_seed(1)
    m = Bigram()
    ids = torch.tensor([[1, 4, 2, 7]])
    logp, ent = token_logprobs(m, ids, torch.ones_like(ids), with_entropy=True)
    p = torch.softmax(m.table[ids[0, :-1]], -1)
    torch.testing.assert_close(ent[0], -(p * p.log()).sum(-1))
    torch.testing.assert_close(logp, token_logprobs(m, ids, torch.ones_like(ids)))


def _rows(*vals):
    return torch.tensor([list(v) for v in vals], dtype=torch.float32)


def test_behaviour_weights_truncate_and_mask_per_token():
    from learner.maths.grpo import behaviour_weights

    prox = _rows([0.0, 0.0, 0.0])
    behav = torch.log(_rows([1.0, 0.25, 0.8]))  # raw w = pi_prox/pi_behav = 1, 4, 1.25
    mask = torch.tensor([[True, True, True]])
    w, st = behaviour_weights(prox, behav, mask, "token_truncate", 2.0)
    assert torch.allclose(w, _rows([1.0, 2.0, 1.25]))
    assert abs(st["is_weight_mean"] - (1 + 4 + 1.25) / 3) < 1e-5 and abs(st["is_weight_max"] - 4.0) < 1e-5
    assert abs(st["is_truncated_frac"] - 1 / 3) < 1e-6
    w, _ = behaviour_weights(prox, behav, mask, "token_mask", 2.0)
    assert torch.allclose(w, _rows([1.0, 0.0, 1.25]))


def test_behaviour_weights_per_sequence_use_the_product_of_token_ratios():
    from learner.maths.grpo import behaviour_weights

    prox = torch.zeros(2, 3)
    behav = torch.log(_rows([0.5, 0.5, 1.0], [1.0, 0.9, 1.0]))  # row products 4 and 1/0.9
    mask = torch.tensor([[True, True, False], [True, True, True]])  # row 0: 3rd token padding
    w, st = behaviour_weights(prox, behav, mask, "sequence_truncate", 2.0)
    assert torch.allclose(w[0, :2], torch.tensor([2.0, 2.0])) and w[0, 2] == 1.0
    assert torch.allclose(w[1], torch.full((3,), 1 / 0.9))
    assert st["is_truncated_frac"] == 0.5
    w, _ = behaviour_weights(prox, behav, mask, "sequence_mask", 2.0)
    assert torch.all(w[0, :2] == 0.0) and torch.allclose(w[1], torch.full((3,), 1 / 0.9))


def test_decoupled_loss_gradient_is_truncated_weight_times_reinforce():
    from learner.maths.grpo import policy_loss

    logp = torch.log(torch.tensor([[0.5, 0.4]])).requires_grad_(True)
    behav = torch.log(torch.tensor([[0.1, 0.4]]))  # token 0 sampled by a policy 5x less likely
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    loss, st = policy_loss(logp, behav, adv, mask, 0.2, normalizer=2.0, proximal_logp=logp.detach(),
                           correction="token_truncate", cap=2.0)
    loss.backward()
    # at pi_theta == pi_prox the ratio is 1 (inside the clip range): d/dlogp = -A * w / normalizer
    assert torch.allclose(logp.grad, torch.tensor([[-2.0 / 2.0, -1.0 / 2.0]]))
    assert abs(st["is_weight_max"] - 5.0) < 1e-4 and st["is_truncated_frac"] == 0.5
    # without proximal log-probs (plain PPO) token 0's ratio 5 is clipped and passes no gradient
    logp.grad = None
    loss, _ = policy_loss(logp, behav, adv, mask, 0.2, normalizer=2.0)
    loss.backward()
    assert logp.grad[0, 0] == 0.0


def test_mismatch_kl_is_zero_on_equal_policies_and_positive_otherwise():
    from learner.maths.grpo import mismatch_kl

    a = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    mask = torch.tensor([[True, True, False]])
    assert mismatch_kl(a, a, mask) == (0.0, 2)
    total, n = mismatch_kl(a + 0.1, a, mask)
    assert n == 2 and abs(total - 2 * (math.exp(0.1) - 1.1)) < 1e-6


def test_chunked_logprobs_and_entropy_match_full_logits_values_and_gradients():
    from exgrpo_async.toy.task import build_model

    torch.manual_seed(0)
    model = build_model(0)
    ids = torch.randint(4, 90, (3, 21))
    att = torch.ones_like(ids)
    att[2, 15:] = 0
    full_logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float() / 0.7
    lse = torch.logsumexp(full_logits, -1)
    ref_lp = full_logits.gather(-1, ids[:, 1:, None])[..., 0] - lse
    ref_ent = lse - (torch.softmax(full_logits, -1) * full_logits).sum(-1)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for chunk in (7, 1000):
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs(model, ids, att, temperature=0.7, with_entropy=True, chunk_tokens=chunk)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
        (lp.sum() + 0.3 * ent.sum()).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5)  # fp32 sums in another order


def test_bf16_compute_runs_the_forward_in_bf16_and_reduces_in_fp32():
    from exgrpo_async.toy.task import build_model

    torch.manual_seed(0)
    model = build_model(0)
    ids = torch.randint(4, 90, (2, 17))
    fp32 = token_logprobs(model, ids, torch.ones_like(ids))
    bf16 = token_logprobs(model, ids, torch.ones_like(ids), bf16=True)
    assert bf16.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    err = float((bf16 - fp32).abs().max())
    assert 1e-5 < err < 0.01  # bf16 rounding shows (0.0025 nats measured here), but it is the same distribution
