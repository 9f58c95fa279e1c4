"""`exgrpo-async eval` with the real vLLM engine and math-verify on the tiny untrained policy.

Its answers are garbage, so correctness is checked against itself: golds taken from its own greedy
output must score 1 and wrong golds 0. A slice of a real benchmark file and the whole CLI (two engine
processes, a verl-format file, the JSON report) run too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from actors.evaluate import evaluate
from exgrpo_async.config import load_config
from tests.integration.helpers import cli

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MATH500 = SHARED_DATA / "qwen_eval" / "math500" / "test.jsonl"
VALID = SHARED_DATA / "exgrpo_luffy" / "valid.parquet"
# With tied embeddings the untrained model tends to repeat the prompt's last character, so prompts that end
# in a digit give greedy answers with numbers in them.
PROBLEMS = ["1+1=2", "What is 7-2? 5", "Sum 4 and 5: 9", "x=3, y=4", "Compute 12/4 = 3", "9^2 is 81"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_own_greedy_answers_score_and_benchmark_slice(tiny_tied, tmp_path):
    from math_verify import parse

    cfg = load_config(None, [])
    toy = write_jsonl(tmp_path / "toy.jsonl", [{"problem": p, "answer": "0"} for p in PROBLEMS])
    files = [toy] + ([MATH500] if MATH500.exists() else [])
    first = evaluate(cfg, str(tiny_tied), files, samples=2, temperature=0.0, max_tokens=24, limit=4)
    assert first["samples"] == 1  # greedy: one sample per question, whatever was asked
    toy_rs = [r for r in first["questions"] if r.source == "toy"]
    assert len(toy_rs) == 4 and all(len(r.rewards) == 1 for r in toy_rs)
    if MATH500.exists():  # a real slice: 4 questions, each generated (they fit) or counted too long
        m = first["by_source"]["math500/test"]
        assert m["questions"] + m["too_long"] == 4 and m["questions"] >= 1
        assert m["samples"] == m["questions"] and m["verifier_errors"] == 0 and m["verifier_timeouts"] == 0
    # golds from the model's own greedy answers (what math-verify reads in them), and a wrong one each
    own = [(p, parse(r.completions[0])) for p, r in zip(PROBLEMS, toy_rs)]
    own = [(p, str(found[1])) for p, found in own if found]
    assert own, f"no greedy answer holds anything math-verify can read: {[r.completions[0] for r in toy_rs]}"
    rows = [{"problem": p, "answer": g, "data_source": "own"} for p, g in own]
    rows += [{"problem": p, "answer": "987654321", "data_source": "wrong"} for p, _ in own]
    second = evaluate(cfg, str(tiny_tied), [write_jsonl(tmp_path / "own.jsonl", rows)], samples=1, temperature=0.0,
                      max_tokens=24)
    assert second["by_source"]["own"]["avg_at_n"] == 1.0 and second["by_source"]["own"]["pass_at_n"] == 1.0
    assert second["by_source"]["wrong"]["avg_at_n"] == 0.0 and second["by_source"]["wrong"]["pass_at_n"] == 0.0
    assert second["overall"]["avg_at_n"] == pytest.approx(0.5)


def test_cli_end_to_end(tiny_tied, tmp_path):
    if not MATH500.exists():
        pytest.skip(f"shared data absent: {MATH500}")
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
