"""exgrpo_async.data: loading the real question files, bad-row errors, prompt rendering, the sampler."""

import json
import logging
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo_async.data import (DataError, Question, QuestionSampler, extract_last_boxed, load_pool, prompt_token_limit,
                               render_prompt, too_long)
from exgrpo_async.toy.task import build_tokenizer

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

# file -> (rows in the README table, rows skipped as bad with skip_bad_rows=True)
EXPECTED = {
    "exgrpo_luffy/valid.parquet": (2259, 0),
    "exgrpo_luffy/test.id.parquet": (6023, 0),
    "qwen_eval/aime24/test.jsonl": (30, 0),
    "qwen_eval/aime25/test.jsonl": (30, 0),
    "qwen_eval/amc23/test.jsonl": (40, 0),
    "qwen_eval/math500/test.jsonl": (500, 0),
    "qwen_eval/minerva_math/test.jsonl": (272, 0),
    "qwen_eval/olympiadbench/test.jsonl": (675, 0),
    "qwen_eval/gsm8k/test.jsonl": (1319, 0),
    "deepscaler_rllm/test/aime.json": (30, 0),
    "deepscaler_rllm/test/amc.json": (83, 0),
    "deepscaler_rllm/test/math.json": (500, 0),
    "deepscaler_rllm/test/minerva.json": (272, 0),
    "deepscaler_rllm/test/olympiad_bench.json": (675, 0),
    "deepscaler_rllm/train/math.json": (7474, 4),  # 2 null answers + 2 empty answers
    "deepscaler_rllm/train/aime.json": (975, 0),
    "one_shot_rlvr/dsr_sub.parquet": (1209, 1),    # 1 empty ground_truth
    "gsm8k_openai/test.jsonl": (1319, 0),
    "gsm8k_openai/train.jsonl": (7473, 0),
}

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def data_file(rel: str) -> str:
    path = DATA / rel
    if not path.is_file():
        pytest.skip(f"shared data file {path} is absent")
    return str(path)


@lru_cache(maxsize=None)
def real_pool(rel: str):
    return load_pool([data_file(rel)], skip_bad_rows=True)


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- real files
@pytest.mark.parametrize("rel", sorted(EXPECTED))
def test_real_file_row_counts_and_answers(rel):
    rows, bad = EXPECTED[rel]
    pool = real_pool(rel)
    assert len(pool.skipped) == bad, pool.skipped
    assert len(pool.questions) == rows - bad
    assert [q.qid for q in pool.questions] == list(range(rows - bad))
    for q in pool.questions:
        assert isinstance(q.answer, str) and q.answer.strip() == q.answer and q.answer
        assert (q.messages is not None and q.problem == "") or (q.messages is None and q.problem.strip())
        assert q.source


def test_all_data_files_are_covered():
    if not DATA.is_dir():
        pytest.skip("shared data folder is absent")
    found = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet")}
    assert found == set(EXPECTED)


def test_skipped_rows_are_named():
    skipped = real_pool("deepscaler_rllm/train/math.json").skipped
    assert [s.split(": ")[1] for s in skipped] == ["row 887", "row 1010", "row 5329", "row 5331"]
    assert "null" in skipped[0] and "empty answer" in skipped[2]
    assert "row 266" in real_pool("one_shot_rlvr/dsr_sub.parquet").skipped[0]


def test_spot_check_answers():
    math500 = real_pool("qwen_eval/math500/test.jsonl").questions
    assert math500[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert math500[0].source == "math500/test" and math500[0].meta["level"] == 2
    gsm = real_pool("gsm8k_openai/test.jsonl").questions
    assert gsm[0].answer == "18" and gsm[146].answer == "2125"  # "#### 2,125"
    assert real_pool("qwen_eval/gsm8k/test.jsonl").questions[0].answer == "18"
    amc23 = real_pool("qwen_eval/amc23/test.jsonl").questions
    assert amc23[0].answer == "27" and not any(q.answer.endswith(".0") for q in amc23)
    assert real_pool("deepscaler_rllm/test/amc.json").questions[0].answer == "142"
    olympiad = real_pool("qwen_eval/olympiadbench/test.jsonl").questions
    assert olympiad[0].answer == "2" and olympiad[0].problem.startswith("Xenia and Sergey")
    rllm_minerva = real_pool("deepscaler_rllm/test/minerva.json").questions
    assert rllm_minerva[0].answer == "9.6"
    assert rllm_minerva[17].answer == "6630.65" and rllm_minerva[17].meta["alt_answers"] == ["6630"]


def test_minerva_boxed_answers_match_exgrpo_ground_truth():
    minerva = real_pool("qwen_eval/minerva_math/test.jsonl").questions
    assert minerva[0].answer == "1.6" and minerva[1].answer == "4.5e33"
    valid = real_pool("exgrpo_luffy/valid.parquet").questions
    for src, rel in [("minerva", "qwen_eval/minerva_math/test.jsonl"), ("math", "qwen_eval/math500/test.jsonl"),
                     ("olympiad_bench", "qwen_eval/olympiadbench/test.jsonl")]:
        assert [q.answer for q in valid if q.source == src] == [q.answer for q in real_pool(rel).questions]


def test_verl_rows():
    valid = real_pool("exgrpo_luffy/valid.parquet").questions
    q = valid[0]
    assert q.source == "aime" and q.answer == "204" and q.problem == "" and q.meta["index"] == 0
    assert [m["role"] for m in q.messages] == ["system", "user"]
    assert q.messages[1]["content"].startswith("Every morning Aya")
    counts = {s: sum(x.source == s for x in valid) for s in {x.source for x in valid}}
    assert counts == {"aime": 240, "aime25": 240, "amc": 332, "math": 500, "minerva": 272, "olympiad_bench": 675}
    dsr = real_pool("one_shot_rlvr/dsr_sub.parquet").questions[0]
    assert dsr.source == "deepscaler" and dsr.answer == r"\frac{3}{7}" and len(dsr.messages) == 1


# ----------------------------------------------------------------------------- formats and bad rows
def test_answer_forms(tmp_path):
    rows = [
        {"problem": "a", "answer": 27.0},
        {"problem": "b", "answer": 2.5},
        {"problem": "c", "answer": 5},
        {"question": "d", "answer": "Work... <<1+1=2>>\n#### 1,450,000"},
        {"problem": "e", "answer": "['4.5e33\\n']"},
        {"problem": "f", "answer": "[1, 2]"},
        {"question": "g", "final_answer": ["$1$", "$2$"]},
        {"problem": "h", "solution": r"so \boxed{1} then \boxed{\frac{1}{2}}."},
        {"problem": "i", "answer": ["x", "y"]},
    ]
    qs = load_pool([write_jsonl(tmp_path / "forms.jsonl", rows)]).questions
    assert [q.answer for q in qs] == ["27", "2.5", "5", "1450000", "4.5e33", "[1, 2]", "$1$, $2$", r"\frac{1}{2}", "x"]
    assert qs[8].meta["alt_answers"] == ["y"] and qs[0].source == "forms"


def test_extract_last_boxed():
    assert extract_last_boxed(r"\boxed{a} and \boxed{\sqrt{x^{2}}}") == r"\sqrt{x^{2}}"
    assert extract_last_boxed("no box") is None and extract_last_boxed(r"\boxed{open {") is None


@pytest.mark.parametrize("row, reason", [
    ('{"problem": "x", "answer": ', "invalid JSON"),
    ({"problem": "x"}, "no answer"),
    ({"problem": "x", "answer": "  "}, "empty answer"),
    ({"problem": "x", "answer": None}, "null"),
    ({"answer": "1"}, "no question text"),
    ([1, 2], "not an object"),
    ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}}, "ground_truth"),
])
def test_bad_jsonl_row_names_file_row_and_line(tmp_path, row, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "ok", "answer": "1"}, "", row])
    with pytest.raises(DataError) as err:
        load_pool([path])
    msg = str(err.value)
    assert "bad.jsonl" in msg and "row 2 (line 3)" in msg and reason in msg


def test_bad_json_and_parquet_rows(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"problem": "ok", "answer": "1"}, "just a string"]))
    with pytest.raises(DataError, match=r"bad\.json: row 2: row is a str, not an object"):
        load_pool([str(path)])
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}], "data_source": "d",
                                   "reward_model": {"ground_truth": gt, "style": "rule"}} for gt in ("1", "")])
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: row 2: empty answer"):
        load_pool([str(tmp_path / "bad.parquet")])


def test_skip_bad_rows_counts_and_logs(tmp_path, caplog):
    rows = [{"problem": "a", "answer": "1"}, "{oops", {"problem": "b"}, [3], {"problem": "c", "answer": ""},
            {"problem": "d", "answer": "4"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="exgrpo_async.data"):
        pool = load_pool([path], skip_bad_rows=True)
    assert [(q.qid, q.problem) for q in pool.questions] == [(0, "a"), (1, "d")]
    assert len(pool.skipped) == 4 and all("mixed.jsonl" in s for s in pool.skipped)
    assert [s.split(": ")[1] for s in pool.skipped] == ["row 2 (line 2)", "row 3 (line 3)", "row 4 (line 4)",
                                                        "row 5 (line 5)"]
    assert sum("skipping" in r.getMessage() for r in caplog.records) == 4


def test_qids_run_over_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"problem": "a1", "answer": "1"}, {"problem": "a2", "answer": "2"}])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([{"problem": "b1", "answer": "3", "data_source": "src"}]))
    qs = load_pool([a, str(b)]).questions
    assert [(q.qid, q.source) for q in qs] == [(0, "a"), (1, "a"), (2, "src")]


def test_file_errors(tmp_path):
    (tmp_path / "q.csv").write_text("problem,answer\n")
    with pytest.raises(DataError, match=r"q\.csv.*unknown file type '\.csv'"):
        load_pool([str(tmp_path / "q.csv")])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="no such file") as err:
        load_pool([str(missing)])
    assert str(missing) in str(err.value)
    (tmp_path / "obj.json").write_text('{"problem": "x"}')
    with pytest.raises(DataError, match="JSON array"):
        load_pool([str(tmp_path / "obj.json")])
    (tmp_path / "broken.json").write_text('[{"problem": ')
    with pytest.raises(DataError, match=r"broken\.json: invalid JSON"):
        load_pool([str(tmp_path / "broken.json")])


# ----------------------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return PreTrainedTokenizerFast.from_pretrained(str(out))


def test_render_verl_messages(tokenizer):
    q = real_pool("exgrpo_luffy/valid.parquet").questions[0]
    with pytest.raises(DataError, match="chat template"):
        render_prompt(q, "{problem}", None, False, tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        text = render_prompt(q, "ignored {problem}", None, False, tokenizer)
        assert text == f"<|system|>{q.messages[0]['content']}\n<|user|>{q.messages[1]['content']}\n<|assistant|>"
        text = render_prompt(q, "{problem}", "Be brief.", True, tokenizer)
        assert text == f"<|system|>Be brief.\n<|user|>{q.messages[1]['content']}\n<|assistant|>"
    finally:
        tokenizer.chat_template = None


def test_the_prompt_limit_is_the_setting_or_what_the_context_leaves_beside_a_completion(tokenizer):
    assert prompt_token_limit(1024, 4096, 3072) == (1024, "data.max_prompt_tokens=1024")  # the 1.5B recipe's: both
    assert prompt_token_limit(100, 256, 64) == (100, "data.max_prompt_tokens=100")
    # the toy's context: 256 tokens, 64 of them for the completion
    assert prompt_token_limit(1024, 256, 64) == (192, "model.max_model_len=256 less rollout.max_new_tokens=64")
    # counted in the tokenizer's tokens (the toy's: one a character), over the limit only
    prompts = ["1+1=", "x" * 192, "x" * 193, "", "y" * 500]
    assert too_long(prompts, tokenizer, 192) == {2, 4}
    assert too_long(prompts, tokenizer, 4) == {1, 2, 4}


def test_render_plain(tokenizer):
    q = Question(qid=0, problem="1+1=", messages=None, answer="2", source="t", meta={})
    assert render_prompt(q, "<bos>{problem}", None, False, tokenizer) == "<bos>1+1="
    assert render_prompt(q, r"{problem} Put it in \boxed{{}}.", "sys", False, None) == r"1+1= Put it in \boxed{}."
    with pytest.raises(DataError, match="doubled"):
        render_prompt(q, r"{problem} \boxed{}", None, False, tokenizer)
    with pytest.raises(DataError, match="use_chat_template"):
        render_prompt(q, "{problem}", None, True, tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        assert render_prompt(q, "Q: {problem}", "S", True, tokenizer) == "<|system|>S\n<|user|>Q: 1+1=\n<|assistant|>"
        assert render_prompt(q, "Q: {problem}", None, True, tokenizer) == "<|user|>Q: 1+1=\n<|assistant|>"
    finally:
        tokenizer.chat_template = None


def test_think_template_opens_the_think_block_after_the_luffy_system_prompt(tokenizer):
    """The authors' template: system message, " User: This is the problem: ", the question, and an
    assistant turn already inside <think>, so a completion is scored after its "</think>"."""
    from exgrpo_async.data import set_chat_template

    q = real_pool("exgrpo_luffy/valid.parquet").questions[0]
    set_chat_template(tokenizer, None)
    assert tokenizer.chat_template is None  # None keeps the tokenizer's own
    set_chat_template(tokenizer, "think")
    try:
        text = render_prompt(q, "{problem}", None, False, tokenizer)
        system, question = q.messages[0]["content"], q.messages[1]["content"]
        assert system.startswith("Your task is to follow a systematic, thorough reasoning process")
        assert text == f"{system} User: This is the problem: {question} Assistant: <think>\n"
    finally:
        tokenizer.chat_template = None


# ----------------------------------------------------------------------------- sampler
def draws(sampler: QuestionSampler, n: int) -> list[int]:
    return [sampler.next() for _ in range(n)]


def test_sampler_epochs_cover_every_qid_once():
    s = QuestionSampler(range(50), seed=3)
    epochs = [draws(s, 50) for _ in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert s.epoch == 2
    s.next()
    assert s.epoch == 3


def test_sampler_is_deterministic_per_seed():
    assert draws(QuestionSampler(range(30), seed=1), 90) == draws(QuestionSampler(range(30), seed=1), 90)
    assert draws(QuestionSampler(range(30), seed=1), 30) != draws(QuestionSampler(range(30), seed=2), 30)


def test_sampler_state_round_trip():
    s = QuestionSampler(range(40), seed=7)
    draws(s, 57)
    s.exclude({1, 2, 3})  # pending mid-epoch: must survive the round trip too
    state = json.loads(json.dumps(s.state_dict()))
    fresh = QuestionSampler(range(40), seed=0)
    fresh.load_state_dict(state)
    assert fresh.epoch == s.epoch == 1
    assert draws(fresh, 120) == draws(s, 120)
    with pytest.raises(ValueError, match="questions"):
        QuestionSampler(range(10)).load_state_dict(state)


def test_sampler_exclude_applies_at_next_epoch():
    epoch0 = draws(QuestionSampler(range(20), seed=0), 20)
    s = QuestionSampler(range(20), seed=0)
    assert draws(s, 5) == epoch0[:5]
    gone = set(epoch0[5:10]) | {epoch0[0]}  # not yet drawn, and already drawn
    s.exclude(gone)
    assert draws(s, 15) == epoch0[5:]  # the current epoch is unchanged
    epoch1 = draws(s, 14)
    assert sorted(epoch1) == sorted(set(range(20)) - gone) and s.epoch == 1
    with pytest.raises(ValueError, match="unknown"):
        s.exclude({99})
    s.exclude(set(range(20)))
    with pytest.raises(ValueError, match="excluded"):
        s.next()


def test_sampler_rejects_empty_pool():
    with pytest.raises(ValueError):
        QuestionSampler([])
