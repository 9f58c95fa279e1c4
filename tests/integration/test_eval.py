"""`exgrpo-async eval` with the real vLLM engine and math-verify.

Accuracy is measured for real: the warm-started toy policy (the one `train` starts from) answers the toy
task's held-out questions greedily, with their true answers as golds (regenerated here by
`toy.make_test_set`, never stored in the repo). Each score must equal an independent check of the same
completion (the toy's own reward: the last \\boxed{N} read as an integer), the averages must be those
scores' means, and the accuracy must agree with the warm start's greedy accuracy that transformers'
generate measured when the policy was built (sft.json). A slice of a real benchmark file and the whole
CLI (two engine processes, a verl-format file, the JSON report) run too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from actors.evaluate import evaluate
from exgrpo_async.config_io import load_config
from exgrpo_async.toy.task import FIRST_PASS, boxed_int_correct, make_test_set
from tests.integration.helpers import cli

pytestmark = pytest.mark.slow  # vLLM engines on the toy policy and a benchmark slice: 1-3 min each

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MATH500 = SHARED_DATA / "qwen_eval" / "math500" / "test.jsonl"
VALID = SHARED_DATA / "exgrpo_luffy" / "valid.parquet"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_toy_accuracy_is_measured_against_true_answers_and_a_benchmark_slice(small, tmp_path):
    from exgrpo_async.runs import resolve_toy

    cfg = resolve_toy(load_config(None, small))  # builds (or reuses) the session's warm-started toy policy
    golds = make_test_set(cfg.toy.seed, per_kind=FIRST_PASS)  # the held-out set's first 200 questions
    toy = write_jsonl(tmp_path / "toy.jsonl", [{"problem": g["problem"], "answer": g["answer"],
                                                "data_source": g["kind"]} for g in golds])
    files = [toy] + ([MATH500] if MATH500.exists() else [])  # without shared data: the toy half, then a skip
    report = evaluate(cfg, cfg.model.path, files, samples=2, temperature=0.0, max_tokens=cfg.rollout.max_new_tokens,
                      limit=40)
    assert report["samples"] == 1  # greedy: one sample per question, whatever was asked
    toy_rs = [r for r in report["questions"] if r.source != "math500/test"]
    assert [(r.source, r.answer) for r in toy_rs] == [(g["kind"], g["answer"]) for g in golds]  # all 200, in order
    assert all(len(r.rewards) == len(r.completions) == 1 for r in toy_rs)
    # every score equals the toy's own reward of the same completion (math-verify not involved)
    mine = [float(boxed_int_correct(r.completions[0], r.answer)) for r in toy_rs]
    assert [r.rewards[0] for r in toy_rs] == mine, [(r.completions[0], r.answer, r.rewards) for r in toy_rs][:10]
    by_kind = report["by_source"]
    for kind in {g["kind"] for g in golds}:
        scores = [m for m, r in zip(mine, toy_rs) if r.source == kind]
        assert by_kind[kind]["avg_at_n"] == pytest.approx(sum(scores) / len(scores))
        assert by_kind[kind]["pass_at_n"] == pytest.approx(sum(scores) / len(scores))  # one greedy sample
    accuracy = sum(mine) / len(mine)
    # a measurement, not a constant: some answers right, most of the hard ones wrong; and the same policy's
    # greedy accuracy on the same questions under transformers' generate, measured when it was built
    assert 0.05 < accuracy < 0.95, accuracy
    sft = json.loads((Path(cfg.model.path).parent / "sft.json").read_text())
    assert accuracy == pytest.approx(sft["greedy_accuracy"], abs=0.03), (accuracy, sft)
    if not MATH500.exists():
        shared_data_absent()
    else:  # a real slice: 40 questions, each generated (they fit) or counted too long
        m = by_kind["math500/test"]
        assert m["questions"] + m["too_long"] == 40 and m["questions"] >= 1
        assert m["samples"] == m["questions"] and m["verifier_errors"] == 0 and m["verifier_timeouts"] == 0


def shared_data_absent() -> None:
    """A visible skip, or under CI (which has ../shared beside the clone) a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"shared data absent in CI: {MATH500}")
    pytest.skip(f"shared data absent: {MATH500}")


def test_cli_end_to_end(tiny_tied, tmp_path):
    if not MATH500.exists():
        shared_data_absent()
    model = Path(shutil.copytree(tiny_tied, tmp_path / "model"))  # plus a chat template, for verl rows
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    data = ["--data", str(MATH500)] + (["--data", str(VALID)] if VALID.exists() else [])
    actors = min(2, len(os.sched_getaffinity(0)))
    out = tmp_path / "report.json"
    proc = subprocess.run(cli(["eval", "--model", str(model), *data, "--limit", "2", "--samples", "2",
                               "--max-tokens", "16", "--temperature", "1.0", "--actors", str(actors),
                               "--out", str(out), "--save-completions", "actor.verifier.timeout_s=30"]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "overall" in proc.stdout and "avg@2" in proc.stdout and str(out) in proc.stdout
    report = json.loads(out.read_text())
    assert report["samples"] == 2 and report["actors"] == actors and report["limit"] == 2
    assert report["by_source"]["math500/test"]["questions"] + report["by_source"]["math500/test"]["too_long"] == 2
    if VALID.exists():  # six sources in one file, two rows each; their long system prompt exceeds 256 positions
        assert set(report["by_source"]) == {"math500/test", "aime", "aime25", "amc", "math", "minerva",
                                            "olympiad_bench"}
        assert sum(m["questions"] + m["too_long"] for m in report["by_source"].values()) == 14
    done = [q for q in report["questions"] if q["rewards"]]
    assert done and all(len(q["rewards"]) == 2 and len(q["completions"]) == 2 for q in done)
    assert report["overall"]["samples"] == 2 * len(done)
