"""`exgrpo-async eval` without vLLM: metrics on hand-made rewards, per-source slicing of every shared data
file, and scoring through the real math-verify pool behind a stub engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from actors.evaluate import (
    QuestionResult,
    aggregate,
    default_out,
    format_table,
    prepare,
    run_shard,
    summarize,
    write_report,
)
from exgrpo_async.config_io import load_config
from exgrpo_async.launcher.cli import main as cli_main

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def result(source: str, rewards: list[float], statuses=None, finish=None, qid: int = 0) -> QuestionResult:
    n = len(rewards)
    return QuestionResult(qid, source, "1", list(rewards), statuses or ["ok"] * n, finish or ["stop"] * n,
                          [10] * n, ["x"] * n)


def test_aggregate_avg_and_pass():
    rs = [result("a", [1, 0, 0, 0], finish=["length", "stop", "stop", "length"]),
          result("a", [0, 0, 0, 0], statuses=["ok", "timeout", "error", "timeout"]),
          result("b", [1, 1, 1, 1]),
          QuestionResult(3, "b", "1")]  # too long: never generated
    m = aggregate(rs)
    assert m["questions"] == 3 and m["too_long"] == 1 and m["samples"] == 12
    assert m["avg_at_n"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["pass_at_n"] == pytest.approx(2 / 3)
    assert (m["verifier_timeouts"], m["verifier_errors"], m["truncated"]) == (2, 1, 2)
    assert m["truncated_frac"] == pytest.approx(2 / 12) and m["response_tokens_mean"] == 10
    s = summarize(rs)
    assert list(s["by_source"]) == ["a", "b"] and s["overall"] == m
    assert s["by_source"]["a"]["avg_at_n"] == pytest.approx(0.125) and s["by_source"]["a"]["pass_at_n"] == 0.5
    assert s["by_source"]["b"]["pass_at_n"] == 1.0 and s["by_source"]["b"]["too_long"] == 1
    empty = aggregate([QuestionResult(0, "c", "1")])
    assert empty["avg_at_n"] is None and empty["pass_at_n"] is None and empty["too_long"] == 1
    table = format_table({"samples": 4, **s})
    assert "avg@4" in table and "pass@4" in table and table.splitlines()[-1].startswith("overall")


def test_report_json_and_default_path(tmp_path, monkeypatch):
    report = {"samples": 1, **summarize([result("a", [1])]), "questions": [result("a", [1])]}
    write_report(report, tmp_path / "r.json")
    row = json.loads((tmp_path / "r.json").read_text())["questions"][0]
    assert row["rewards"] == [1] and "completions" not in row
    write_report(report, tmp_path / "r.json", save_completions=True)
    assert json.loads((tmp_path / "r.json").read_text())["questions"][0]["completions"] == ["x"]
    (tmp_path / "model").mkdir()
    assert default_out(str(tmp_path / "model")).parent == tmp_path
    monkeypatch.chdir(tmp_path / "model")
    assert default_out("org/hub-id").parent == tmp_path / "model"


def test_limit_is_per_data_source(tmp_path):
    rows = [{"problem": f"q{i}", "answer": str(i), "data_source": "ab"[i % 2]} for i in range(6)]
    rows.append({"problem": "no answer"})  # bad rows are skipped and listed, not fatal
    f = tmp_path / "mix.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    qs, prompts, skipped = prepare([str(f)], 2, None, "Q: {problem}", None, False)
    assert [(q.source, q.answer) for q in qs] == [("a", "0"), ("b", "1"), ("a", "2"), ("b", "3")]
    assert prompts[0] == "Q: q0" and len(skipped) == 1


class ChatTokenizer:
    chat_template = "stub"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.mark.parametrize("rel", sorted(str(p.relative_to(SHARED_DATA)) for p in SHARED_DATA.rglob("*")
                                       if p.suffix in (".jsonl", ".json", ".parquet")) or ["(none)"])
def test_every_shared_file_loads_and_renders(rel):
    if rel == "(none)":
        pytest.skip(f"no shared data under {SHARED_DATA}")
    qs, prompts, _ = prepare([str(SHARED_DATA / rel)], 3, ChatTokenizer(), "{problem}", None, False)
    assert qs and len(prompts) == len(qs) and all(p.strip() for p in prompts) and all(q.answer for q in qs)
    assert max(sum(q.source == s for q in qs) for s in {q.source for q in qs}) <= 3


class StubEngine:
    """Answers prompt P with the texts COMPLETIONS[P], as token ids (one char each)."""
    COMPLETIONS = {"p0": ["\\boxed{4}", "\\boxed{5}"], "p1": ["\\boxed{6630}", "no idea"],
                   "p2": ["so it is 0.5", "$\\frac{2}{4}$"], "p3": ["\\boxed{1}", "\\boxed{2}"]}

    def __init__(self, *args, **kwargs):
        self.llm = self
        self.closed = False

    def get_tokenizer(self):
        return self

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))

    def generate(self, prompts, n, temperature, max_tokens):
        from actors.engine import Sample

        return [(np.zeros(1, np.int32), [Sample(np.array([ord(c) for c in t], np.int32), np.zeros(len(t), np.float32),
                                                "length" if "idea" in t else "stop") for t in self.COMPLETIONS[p][:n]])
                for p in prompts]

    def close(self):
        pass


def test_scoring_any_gold_may_match(monkeypatch):
    import actors.engine
    from actors.evaluate import EvalJob

    monkeypatch.setattr(actors.engine, "VLLMEngine", StubEngine)
    cfg = load_config(None, [])
    job = EvalJob("stub", cfg.model, cfg.actor.engine, cfg.actor.verifier, 2, 1.0, 16, 0, 1)
    golds = [["4"], ["6630.65", "6630"], ["\\frac{1}{2}"], ["7"]]
    results = [QuestionResult(i, "s", g[0]) for i, g in enumerate(golds)]
    out = run_shard(job, ["p0", "p1", "p2", "p3"], golds, results)
    assert [r.rewards for r in out] == [[1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    assert out[1].finish_reasons == ["stop", "length"] and out[0].tokens == [9, 9]
    m = aggregate(out)
    assert m["avg_at_n"] == pytest.approx(0.5) and m["pass_at_n"] == 0.75 and m["truncated"] == 1



def test_eval_scores_with_a_custom_reward_function(monkeypatch):
    """`exgrpo-async eval` with actor.verifier.function: the function gets each question's row (by_row:
    question_id / 10), the best over a question's golds counts, and pass@N needs a reward of 1."""
    import actors.engine
    from actors.evaluate import EvalJob

    monkeypatch.setattr(actors.engine, "VLLMEngine", StubEngine)
    cfg = load_config(None, ["actor.verifier.function=tests.reward_fns:by_row"])
    job = EvalJob("stub", cfg.model, cfg.actor.engine, cfg.actor.verifier, 2, 1.0, 16, 0, 1)
    golds = [["4"], ["6630.65", "6630"], ["\\frac{1}{2}"], ["7"]]
    results = [QuestionResult(i, "s", g[0]) for i, g in enumerate(golds)]
    out = run_shard(job, ["p0", "p1", "p2", "p3"], golds, results)
    assert [r.rewards for r in out] == [[0.0, 0.0], [0.1, 0.1], [0.2, 0.2], [0.3, 0.3]]
    m = aggregate(out)
    assert m["avg_at_n"] == pytest.approx(0.15) and m["pass_at_n"] == 0.0 and m["verifier_errors"] == 0


def test_cli_rejects_missing_model_and_bad_numbers(capsys):
    assert cli_main(["eval", "--data", "x.jsonl"]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli_main(["eval", "--model", "m", "--data", "x.jsonl", "--samples", "0"]) == 2
    assert "--samples" in capsys.readouterr().err


def test_best_weights_score_is_the_mean_over_sources_minerva_left_out():
    from learner.inbox import source_score

    by_source = {"aime": 0.1, "math": 0.7, "minerva": 0.0, "olympiad_bench": 0.4}
    assert source_score(by_source, ["minerva"]) == pytest.approx((0.1 + 0.7 + 0.4) / 3)
    assert source_score(by_source, []) == pytest.approx(1.2 / 4)
    assert source_score({"minerva": 0.3}, ["minerva"]) is None


def test_held_out_standard_error_counts_the_spread_over_questions():
    from learner.inbox import standard_error

    # four questions: two always right, two always wrong: sd 0.577 over sqrt(4)
    assert standard_error([1.0, 1.0, 0.0, 0.0]) == pytest.approx(math.sqrt(1 / 3) / 2)
    # the same mean with every question half right has no spread between questions
    assert standard_error([0.5, 0.5, 0.5, 0.5]) == 0.0
    # four times the questions halve it
    assert standard_error([1.0, 0.0] * 8) == pytest.approx(math.sqrt(4 / 15) / 4)
    assert standard_error([0.7]) == 0.0


def test_held_out_sampling_error_holds_the_questions_fixed():
    from learner.inbox import sampling_error

    # always right or always wrong: the samples add no noise, however far apart the questions are
    assert sampling_error([[1.0, 1.0], [0.0, 0.0]]) == 0.0
    # one question right in 2 of 4: p(1-p)/(k-1) = 0.25/3; two such questions: sqrt(2 * 0.25/3) / 2
    assert sampling_error([[1.0, 0.0, 1.0, 0.0]]) == pytest.approx(math.sqrt(0.25 / 3))
    assert sampling_error([[1.0, 0.0, 1.0, 0.0]] * 2) == pytest.approx(math.sqrt(2 * 0.25 / 3) / 2)
    # the unbiased estimate: the mean over many draws of the estimated variance is the true one
    rng = np.random.default_rng(0)
    draws = [sampling_error([(rng.random(8) < 0.3).astype(float).tolist()]) ** 2 for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(0.3 * 0.7 / 8, rel=0.05)
    assert sampling_error([]) == 0.0 and sampling_error([[1.0]]) == 0.0


def test_held_out_sampling_error_takes_rewards_that_are_not_0_or_1():
    from learner.inbox import sampling_error

    # rewards 0.2 and 0.6 (a custom reward function): sample variance 0.08, over k = 2, one question
    assert sampling_error([[0.2, 0.6]]) == pytest.approx(math.sqrt(0.08 / 2))
