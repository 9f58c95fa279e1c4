"""ops/bench/learning/peer.py's two readings of "as accurate as TRL, in how much of its time": the first-crossing
rule and the equal-steps figures. Synthetic runs: the crossing rule flips on a gap far below the
seeds' spread; the equal-steps figures do not. And ops/bench/system/balance.py's split of a step into the
learner's work and the rest, which predicts the learner's idle share on full shared cores."""

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def peer():
    return load_bench("learning/peer")


def runs(points: list[list[tuple[int, float, float]]]) -> list[list[dict]]:
    return [[{"step": st, "seconds": s, "accuracy": a} for st, s, a in seed] for seed in points]


def test_equal_steps_reads_time_and_both_accuracies_at_trls_last_step(peer):
    res = {"trl": runs([[(100, 200.0, 0.40)], [(100, 220.0, 0.38)], [(100, 180.0, 0.39)]]),
           "ours": runs([[(50, 40.0, 0.36), (100, 80.0, 0.389)], [(50, 45.0, 0.37), (100, 90.0, 0.41)],
                         [(50, 50.0, 0.35), (100, 100.0, 0.38)]])}
    eq = peer.at_equal_steps(res, "ours")
    assert eq["step"] == 100 and eq["ratio"] == pytest.approx(90.0 / 200.0)
    assert eq["ratio_per_seed"] == pytest.approx([0.4, 0.45, 0.5])
    assert eq["avg8"] == [0.389, 0.41, 0.38] and eq["avg8_trl"] == [0.40, 0.38, 0.39]
    assert eq["avg8_median_diff"] == pytest.approx(0.389 - 0.39)
    tt = peer.time_to(res, "ours")  # 0.001 short of TRL's median: the crossing rule finds no time at all
    assert tt["ratio"] is None and tt["target_avg8"] == 0.39


def test_equal_steps_needs_a_checkpoint_at_trls_step(peer):
    res = {"trl": runs([[(100, 200.0, 0.40)]]), "ours": runs([[(50, 40.0, 0.36), (75, 60.0, 0.4)]])}
    assert peer.at_equal_steps(res, "ours") is None
    assert peer.at_equal_steps({"ours": res["ours"]}, "ours") is None


def test_balance_split_predicts_the_learners_idle_share_from_the_two_sides_work():
    balance = load_bench("system/balance")
    start = [{"step_seconds": 9.0, "wait_seconds": 9.0, "cores_busy_frac": 0.1}] * 5  # left out
    rows = start + [{"step_seconds": 1.0, "wait_seconds": 0.2, "cores_busy_frac": 1.0},
                    {"step_seconds": 1.0, "wait_seconds": 0.2, "cores_busy_frac": 1.0}]
    r = balance.work_split(rows, cores=2)
    assert (r["step_s"], r["learner_s"]) == pytest.approx((1.0, 0.8))
    assert (r["rest_core_s"], r["rest_over_learner"]) == pytest.approx((1.2, 1.5))
    assert (r["idle_predicted"], r["idle_measured"]) == pytest.approx((0.2, 0.2))
    half = balance.work_split(start + [dict(x, cores_busy_frac=0.5) for x in rows[5:]], cores=2)
    assert half["rest_core_s"] == pytest.approx(0.2)  # cores half idle: the rest did 0.2 core-s


def test_balance_reads_the_rollouts_age_after_start_up():
    balance = load_bench("system/balance")
    rows = [{"staleness_mean": 9.0, "is_weight_max": 9.0}] * 5 + [
        {"staleness_mean": 1.0, "is_weight_max": 1.2}, {"staleness_mean": 2.0, "is_weight_max": 1.6},
        {"staleness_mean": 1.5, "is_weight_max": 3.0}]
    assert balance.staleness(rows) == pytest.approx({"staleness_mean": 1.5, "is_weight_max_median": 1.6})
