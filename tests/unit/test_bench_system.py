"""ops/bench/system/'s benchmarks that measure the system's parts on CPU, each in a tiny run that must pass:
the experience buffer (system/buffer.py), the Prometheus export (system/metrics.py), the learner's pass
(system/learner_pass.py) and a run's balance (system/balance.py) in this process, and the transport
(system/transport.py) as a script, its sender a spawned process. Each asserts on the JSON the script
writes: its keys, and figures finite and in a sane range (not the targets, which a tiny run on a busy
machine says nothing about)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import load_bench

REPO = Path(__file__).resolve().parents[2]


def run_main(name: str, monkeypatch, *argv: str):
    """ops/bench/NAME.py's main() in this process, with these arguments."""
    mod = load_bench(name)
    monkeypatch.setattr(sys, "argv", [f"ops/bench/{name}.py", *argv])
    return mod.main()


def finite(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


@pytest.mark.timeout(60)
def test_buffer_bench_tiny_run(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"  # a run's mixed steps, for the selection share
    metrics.write_text("".join(json.dumps({"exgrpo_mixed": mixed, "selection_seconds": sel, "step_seconds": 2.0}) + "\n"
                               for mixed, sel in ((False, None), (True, 0.1), (True, 0.3))))
    out = tmp_path / "buffer.json"
    run_main("system/buffer", monkeypatch, "--sizes", "400,2000", "--bytes-trajectories", "40",
             "--metrics", str(metrics), "--out", str(out))
    res = json.loads(out.read_text())
    assert [r["trajectories"] for r in res["rows"]] == [400, 2000]
    assert [r["questions"] for r in res["rows"]] == [100, 500]  # 4 trajectories a question
    for r in res["rows"]:
        assert finite(r["insert_us"], r["sample_ms"]) and 0 < r["insert_us"] < 10_000 and 0 < r["sample_ms"] < 1_000
    assert finite(res["bytes_per_token"]) and 1 < res["bytes_per_token"] < 100  # int32 id + fp32 log-prob: 8
    assert isinstance(res["sample_pass"], bool) and isinstance(res["bytes_pass"], bool)
    assert res["selection"] == pytest.approx({"steps": 2, "selection_s": 0.2, "step_s": 2.0, "share": 0.1})


@pytest.mark.timeout(60)
def test_metrics_bench_tiny_run(tmp_path, monkeypatch):
    out = tmp_path / "metrics.json"
    run_main("system/metrics", monkeypatch, "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res) == {"learner_observe_step_us", "step_seconds", "learner_share", "actor_observe_group_us",
                        "group_seconds", "actor_share", "learner_scrape_bytes", "learner_scrape_ms",
                        "actor_scrape_bytes", "actor_scrape_ms"}
    assert finite(*res.values())
    assert 0 < res["learner_observe_step_us"] < 100_000 and 0 < res["actor_observe_group_us"] < 100_000
    assert 0 < res["learner_share"] < 0.1 and 0 < res["actor_share"] < 0.5
    assert res["learner_scrape_bytes"] > 1000 and res["actor_scrape_bytes"] > 1000  # the endpoints' families
    assert 0 < res["learner_scrape_ms"] < 5_000 and 0 < res["actor_scrape_ms"] < 5_000


@pytest.mark.timeout(120)
def test_learner_pass_bench_tiny_run(tmp_path, monkeypatch):
    out = tmp_path / "learner_pass.json"
    run_main("system/learner_pass", monkeypatch, "--seqs", "10", "--reps", "1", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["args"]["seqs"] == 10 and res["real_tokens"] > 10 * 20  # prompts of 9-21 tokens, completions 10-64
    assert len(res["rows"]) == 10 and len({r["layout"] for r in res["rows"]}) == 10
    for r in res["rows"]:  # every layout feeds every real token at least once (padded or packed)
        assert finite(r["seconds"]) and 0 < r["seconds"] < 60 and r["tokens"] >= res["real_tokens"], r


@pytest.mark.timeout(120)
def test_transport_bench_tiny_run(tmp_path):
    out = tmp_path / "transport.json"
    proc = subprocess.run([sys.executable, str(REPO / "ops/bench/system/transport.py"), "--tokens", "64",
                           "--groups", "40", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MB/s between two processes at 64 tokens" in proc.stdout and f"wrote {out}" in proc.stdout
    res = json.loads(out.read_text())
    assert res["target_mb_per_s"] == 1000.0 and isinstance(res["pass"], bool)
    (r,) = res["rows"]
    assert (r["tokens"], r["groups"]) == (64, 40) and len(r["zmq_seconds"]) == len(r["memcpy_seconds"]) == 1
    assert r["bytes_per_group"] >= 8 * 64 * 8 + 64 * 4  # K completions of int32 ids + fp32 log-probs, the prompt
    for key in ("zmq_mb_per_s", "zmq_pre_encoded_mb_per_s", "memcpy_mb_per_s", "ratio", "encode_us_per_group",
                "decode_us_per_group"):
        assert finite(r[key]) and r[key] > 0, key
    assert r["zmq_rollouts_per_s"] == pytest.approx(8 * r["zmq_groups_per_s"])


@pytest.mark.timeout(30)
def test_balance_bench_tiny_run(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run-1"  # a finished run's metrics: one start-up step left out, two steps read
    run.mkdir()
    rows = [{"step_seconds": 9.0, "wait_seconds": 9.0, "cores_busy_frac": 0.1, "staleness_mean": 0.0,
             "is_weight_max": 1.0}] + [{"step_seconds": 1.0, "wait_seconds": 0.2, "cores_busy_frac": 1.0,
                                        "staleness_mean": s, "is_weight_max": w} for s, w in ((1.0, 1.2), (2.0, 1.6))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "balance.json"
    run_main("system/balance", monkeypatch, str(run), "--cores", "2", "--skip", "1", "--out", str(out))
    res = json.loads(out.read_text())[str(run)]
    assert res == pytest.approx({"step_s": 1.0, "learner_s": 0.8, "rest_core_s": 1.2, "rest_over_learner": 1.5,
                                 "cores_busy": 1.0, "idle_predicted": 0.2, "idle_measured": 0.2,
                                 "staleness_mean": 1.5, "is_weight_max_median": 1.4})
    assert f"| {run} | 1.000 | 0.800 | 1.200 | 1.50 | 100% | 20.0% | 20.0% | 1.50 | 1.40 |" in capsys.readouterr().out
