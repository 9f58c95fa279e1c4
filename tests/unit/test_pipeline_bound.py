"""ops/bench/system/pipeline.py's overlap bound: no run of an invocation can pass it, and one that does (a broken
measurement) is reported as INVALID with exit status 3, not as a target met. Synthetic metrics rows."""

import json
import random
import sys

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def pipeline():
    return load_bench("system/pipeline")


def _row(rng: random.Random, gen_fast: float, train_fast: float, overhead: float, sync: bool) -> dict:
    """One step as the learner writes it: the train, bookkeeping and publish stretches inside the step, the
    actors' idle share in [0, 1] (a step's generating seconds at most the step)."""
    train, exgrpo, publish = train_fast * rng.uniform(1, 1.3), rng.uniform(0, 0.05), rng.uniform(0.001, 0.01)
    gen = gen_fast * rng.uniform(1, 1.4)
    learner_work = train + exgrpo + publish
    if sync:  # wait = generation plus the actor's overheads, then train
        wait = gen + overhead * rng.uniform(0, 1)
    else:  # a batch is often ready at once: skewed, sometimes very short steps
        wait = max(0.0, gen - learner_work) * rng.choice([0.0, 0.2, 1.0]) + overhead * rng.uniform(0, 0.1)
    step = wait + learner_work + rng.uniform(0, 0.05)
    return {"step_seconds": step, "wait_seconds": wait, "train_seconds": train, "exgrpo_seconds": exgrpo,
            "publish_seconds": publish, "actor_idle_frac": max(0.0, 1 - min(gen, step) / step),
            "rollouts": 256, "reward_mean": 0.25, "staleness_mean": 0.0 if sync else 0.9, "sync_seconds": 0.004}


def test_no_run_passes_the_bound_even_with_large_synchronous_overheads(pipeline):
    rng = random.Random(0)
    for trial in range(200):
        gen_fast, train_fast, overhead = rng.uniform(0.3, 2), rng.uniform(0.3, 2), rng.uniform(0, 2)
        rounds = []
        for _ in range(rng.choice([1, 2, 3])):
            rounds.append({eta: pipeline.summarize([_row(rng, gen_fast, train_fast, overhead, eta == 0)
                                                    for _ in range(rng.randint(6, 30))], 5) for eta in (0, 1, 2)})
        pure = pipeline.pure_times([(f"{eta}/{k}", s) for k, rnd in enumerate(rounds) for eta, s in rnd.items()])
        for rnd in rounds:
            for s in rnd.values():
                pipeline.add_ideal(s, pure)
                assert s["of_ideal_rate"] <= 1.0 + 1e-12, (trial, s)
        results = {eta: pipeline.median_summary([r[eta] for r in rounds]) for eta in (0, 1, 2)}
        pipeline.judge(results, results[0])
        for r in results.values():
            assert r["of_bound"] <= 1.0 + 1e-12, (trial, r)
            assert r["of_bound"] == pytest.approx(r["speedup"] / r["bound"])


def test_the_old_definition_was_passed_by_the_same_rows(pipeline):
    """The figures the old bound gave (eta=1 above 100%) come from rows like these: the synchronous wait
    holds overheads the pipeline hides. The new bound is not passed by them."""
    sync = [{"step_seconds": 2.7, "wait_seconds": 1.63, "train_seconds": 1.0, "exgrpo_seconds": 0.0,
             "publish_seconds": 0.005, "actor_idle_frac": 0.42, "rollouts": 256, "reward_mean": 0.25,
             "staleness_mean": 0.0, "sync_seconds": 0.004}] * 10
    async1 = [{**sync[0], "step_seconds": 1.31, "wait_seconds": 0.3, "actor_idle_frac": 0.03,
               "staleness_mean": 0.84}] * 10
    s0, s1 = pipeline.summarize(sync, 0), pipeline.summarize(async1, 0)
    old_bound = 2.7 / max(1.63, 2.7 - 1.63)
    assert (s1["rollouts_per_s"] / s0["rollouts_per_s"]) / old_bound > 1.2  # what the old table printed as 124%
    pure = pipeline.pure_times([("0", s0), ("1", s1)])
    for s in (s0, s1):
        pipeline.add_ideal(s, pure)
    results = {0: s0, 1: s1}
    pipeline.judge(results, s0)
    assert results[1]["of_bound"] <= 1.0
    assert results[1]["of_bound"] == pytest.approx(max(1.31 * 0.97, 1.005) / 1.31)


def test_a_ratio_above_the_bound_is_invalid_not_a_success(pipeline, monkeypatch, tmp_path):
    """A broken clock (the update longer than its own step) passes the bound: the script says INVALID,
    writes bound_violated and exits 3."""
    good = {"step_seconds": 2.0, "wait_seconds": 1.0, "train_seconds": 0.9, "exgrpo_seconds": 0.0,
            "publish_seconds": 0.01, "actor_idle_frac": 0.5, "rollouts": 256, "reward_mean": 0.25,
            "staleness_mean": 0.0, "sync_seconds": 0.004}
    broken = {**good, "step_seconds": 0.5, "wait_seconds": 0.0, "actor_idle_frac": 0.0}  # train 0.9 s in a 0.5 s step
    monkeypatch.setattr(pipeline, "run_once", lambda eta, *a: [good if eta == 0 else broken] * 8)
    out = tmp_path / "pipeline.json"
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--etas", "0,1", "--steps", "8", "--out", str(out)])
    assert pipeline.main() == pipeline.INVALID_EXIT
    report = json.loads(out.read_text())
    assert report["bound_violated"] is True and report["pass"] is False


def test_a_consistent_invocation_is_judged_on_the_target(pipeline, monkeypatch, tmp_path, capsys):
    sync = {"step_seconds": 2.0, "wait_seconds": 1.0, "train_seconds": 0.9, "exgrpo_seconds": 0.0,
            "publish_seconds": 0.01, "actor_idle_frac": 0.5, "rollouts": 256, "reward_mean": 0.25,
            "staleness_mean": 0.0, "sync_seconds": 0.004}
    async1 = {**sync, "step_seconds": 1.05, "wait_seconds": 0.1, "actor_idle_frac": 0.05, "staleness_mean": 0.9}
    monkeypatch.setattr(pipeline, "run_once", lambda eta, *a: [sync if eta == 0 else async1] * 8)
    out = tmp_path / "pipeline.json"
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--etas", "0,1", "--steps", "8", "--out", str(out)])
    assert pipeline.main() == 0
    report = json.loads(out.read_text())
    assert report["bound_violated"] is False and report["pass"] is True
    # G* = 0.95 x 1.05 (eta=1 generated a step's worth faster than eta=0's 1.0 s), T* = 0.91
    assert report["results"]["1"]["of_bound"] == pytest.approx(0.95 * 1.05 / 1.05)
    assert "target: eta=1 >= 90% of the bound: met" in capsys.readouterr().out
