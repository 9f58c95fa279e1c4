"""The toy warm start: a fixed step count (deterministic, whatever the machine load), its lr schedule, the
renamed config key, and the held-out accuracy check that follows every build."""

from __future__ import annotations

import pytest
import torch

from exgrpo_async.config import ToyConfig
from exgrpo_async.config_io import load_config
from exgrpo_async.toy.task import (
    EOS,
    PAD,
    PROMPT_TEMPLATE,
    WARM_START_BAND,
    band_warnings,
    boxed_int_correct,
    build_model,
    build_tokenizer,
    make_test_set,
    policy_accuracy,
    score_completions,
    sft,
    sft_lr_factor,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("toktok")
    build_tokenizer(d)
    return PreTrainedTokenizerFast.from_pretrained(str(d))


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny work; leave the other core alone
    yield
    torch.set_num_threads(prev)


def _tiny_sft(tokenizer, seed: int, steps: int = 5, disturb: int = 1):
    model = build_model(0)
    for layer in model.model.layers:  # randomness inside the step: only sft's own seeding makes it repeatable
        layer.self_attn.attention_dropout = 0.1
    torch.rand(disturb)  # and the global generator is left elsewhere on each call
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    summary = sft(model, tokenizer, steps, exclude=set(), seed=seed, rows=2, row_len=64, log_every=0)
    return model, summary, len(calls)


def test_sft_runs_exactly_its_steps_and_is_deterministic(tokenizer):
    init = {k: v.clone() for k, v in build_model(0).state_dict().items()}
    a, summary, forwards = _tiny_sft(tokenizer, seed=0)
    b, _, _ = _tiny_sft(tokenizer, seed=0, disturb=7)
    c, _, _ = _tiny_sft(tokenizer, seed=1)
    assert forwards == 5 and summary["sft_steps"] == 5
    assert set(summary) == {"sft_steps", "sft_final_loss", "sft_seconds"} and summary["sft_final_loss"] > 0
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "same seed, same steps: weights must be identical"
    assert not all(torch.equal(sa[k], init[k]) for k in sa), "SFT did not change the weights"
    assert not all(torch.equal(sa[k], sc[k]) for k in sa), "another seed should see other data"


def test_sft_lr_schedule_spans_exactly_the_steps():
    f = [sft_lr_factor(s, 450) for s in range(450)]
    assert f[0] == pytest.approx(1 / 50) and f[49] == pytest.approx(1.0) and f[50] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1) and min(f[50:]) == pytest.approx(0.1)
    assert all(x >= y for x, y in zip(f[50:], f[51:]))  # cosine only goes down
    short = [sft_lr_factor(s, 5) for s in range(5)]  # warm-up is at most half of a short run
    assert short[1] == pytest.approx(1.0) and short[-1] == pytest.approx(0.1)


def test_config_rejects_sft_seconds_naming_its_replacement():
    with pytest.raises(ValueError, match=r"toy\.sft_seconds was replaced by toy\.sft_steps"):
        load_config(None, ["toy.sft_seconds=150"])
    with pytest.raises(ValueError, match="sft_steps"):
        ToyConfig(sft_seconds=150.0)
    with pytest.raises(ValueError):
        ToyConfig(sft_steps=0)
    assert load_config(None, ["toy.sft_steps=12"]).toy.sft_steps == 12
    assert ToyConfig().sft_steps == 600


def test_boxed_reward():
    assert boxed_int_correct("50+80=130,5+4=9,130+9=139,\\boxed{139}", "139")
    assert not boxed_int_correct("50+80=130,5+4=9,130+9=139,\\boxed{138}", "139")
    assert boxed_int_correct("\\boxed{7},\\boxed{139}", "139")  # the last box counts
    assert not boxed_int_correct("\\boxed{139},\\boxed{7}", "139")
    assert not boxed_int_correct("139", "139") and not boxed_int_correct("\\boxed{1.5}", "139")


def test_score_completions_with_the_real_tokenizer(tokenizer):
    right = "50+80=130,5+4=9,130+9=139,\\boxed{139}" + EOS + PAD + PAD
    wrong = "50+80=130,5+4=9,130+9=138,\\boxed{138}" + EOS + PAD + PAD
    after_eos = "\\boxed{139}" + EOS + "\\boxed{5}"  # nothing after the first eos counts
    ids = [tokenizer(t)["input_ids"] for t in (right, wrong, after_eos)]
    assert score_completions(tokenizer, ids, ["139", "139", "139"]) == [1.0, 0.0, 1.0]
    assert score_completions(tokenizer, ids, ["138", "138", "5"]) == [0.0, 1.0, 0.0]


class _Oracle(torch.nn.Module):
    """Stands in for the policy: answers each prompt with `\\boxed{true answer + off}`; records the calls."""

    def __init__(self, tokenizer, off: int = 0):
        super().__init__()
        self.tok, self.off, self.calls = tokenizer, off, []

    def generate(self, input_ids, attention_mask, **kw):
        self.calls.append((input_ids.clone(), attention_mask.clone(), kw))
        tails = []
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tok.decode([t for t, m in zip(row, mask) if m], skip_special_tokens=True)
            tails.append(self.tok(f"\\boxed{{{eval(prompt.rstrip('=')) + self.off}}}{EOS}")["input_ids"])
        width = max(map(len, tails))
        tails = [t + [self.tok.pad_token_id] * (width - len(t)) for t in tails]
        return torch.cat([input_ids, torch.tensor(tails)], dim=1)


def test_policy_accuracy_scores_generations_left_padded(tokenizer):
    rows = make_test_set(0, per_kind=2)
    oracle = _Oracle(tokenizer)
    assert policy_accuracy(oracle, tokenizer, rows, samples=3, batch_size=4) == {"greedy": 1.0, "sampled": 1.0}
    assert policy_accuracy(_Oracle(tokenizer, off=1), tokenizer, rows) == {"greedy": 0.0, "sampled": 0.0}
    greedy_calls = [c for c in oracle.calls if not c[2]["do_sample"]]
    sampled_calls = [c for c in oracle.calls if c[2]["do_sample"]]
    assert sum(len(c[0]) for c in greedy_calls) == 10 and sum(len(c[0]) for c in sampled_calls) == 30
    assert all(c[2]["temperature"] == 1.0 and c[2]["top_k"] == 0 and c[2]["top_p"] == 1.0 for c in sampled_calls)
    ids, mask, kw = greedy_calls[0]
    assert kw["pad_token_id"] == tokenizer.pad_token_id == 0
    assert mask[:, -1].all() and not mask[:, 0].all(), "prompts of unequal length must be left-padded"
    first = tokenizer.decode(ids[0][mask[0].bool()])
    assert first == PROMPT_TEMPLATE.format(problem=rows[0]["problem"])
    assert tokenizer.padding_side == "right"  # restored


def test_policy_accuracy_runs_real_generate(tokenizer):
    acc = policy_accuracy(build_model(0), tokenizer, make_test_set(0, per_kind=1), samples=2, max_new_tokens=8)
    assert set(acc) == {"greedy", "sampled"} and all(0.0 <= v <= 1.0 for v in acc.values())


def test_band_warnings():
    inside = {k: (lo + hi) / 2 for k, (lo, hi) in WARM_START_BAND.items()}
    assert band_warnings(inside) == []
    low = dict(inside, greedy=0.0)
    (line,) = band_warnings(low)
    assert line.startswith("greedy 0.000 not in")


def test_two_builders_at_once_take_turns_and_the_second_reuses_the_first(tmp_path, monkeypatch):
    """Two callers of ensure_toy_assets at once (two commands, or the suite's two workers) build the
    warm start once: the second waits on the lock, then finds it done (the build is a fake that records
    each run and takes a while, so that the two overlap)."""
    import threading
    import time

    from exgrpo_async.toy import task as toy

    builds = []

    def slow_build(root, paths, *args):
        builds.append(root)
        time.sleep(0.5)
        (root / "done").write_text("ok\n")

    monkeypatch.setattr(toy, "_build_toy_assets", slow_build)
    got = []
    callers = [threading.Thread(target=lambda: got.append(toy.ensure_toy_assets(tmp_path, 0, 3))) for _ in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(10)
    assert len(got) == 2 and got[0] == got[1] and len(builds) == 1
