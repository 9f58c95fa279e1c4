"""The held-out gain the demo proves: after - before on the same questions, with the standard error of the
paired difference (learner/inbox.py paired_gain), and the lines `train` prints for it."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from exgrpo_async.launcher.summary import gain_lines
from learner.inbox import paired_gain, standard_error, without_per_question


def _eval(per_question: list[float | None], greedy: list[float | None]) -> dict:
    return {"accuracy": 0.0, "per_question": per_question, "per_question_greedy": greedy}


def test_the_paired_error_is_the_spread_of_each_questions_own_change():
    before = [0.0, 0.5, 1.0, 0.25, 0.75]
    after = [0.5, 0.5, 1.0, 0.75, 1.0]
    g = paired_gain(_eval(before, [0, 1, 1, 0, 1]), _eval(after, [1, 1, 1, 0, 1]))
    d = [0.5, 0.0, 0.0, 0.5, 0.25]
    assert g["sampled"] == pytest.approx(sum(d) / 5)
    assert g["sampled_se"] == pytest.approx(statistics.stdev(d) / math.sqrt(5))
    assert g["greedy"] == pytest.approx(0.2) and g["greedy_se"] == pytest.approx(standard_error([1, 0, 0, 0, 0]))
    assert g["sampled_questions"] == g["greedy_questions"] == 5


def test_pairing_removes_how_hard_the_questions_are():
    """Questions of very different difficulty, each a little better after: the unpaired error (the two
    evaluations' errors combined) is large, the paired one small, and the gain is the same."""
    rng = random.Random(0)
    before = [rng.random() * 0.9 for _ in range(400)]
    after = [b + 0.05 + rng.uniform(-0.02, 0.02) for b in before]
    g = paired_gain(_eval(before, before), _eval(after, after))
    unpaired = math.hypot(standard_error(before), standard_error(after))
    assert g["sampled"] == pytest.approx(0.05, abs=0.005)
    assert g["sampled_se"] < unpaired / 10


def test_questions_missing_from_either_evaluation_are_left_out_and_old_evaluations_give_none():
    g = paired_gain(_eval([0.0, None, 0.5], [0, 0, None]), _eval([1.0, 1.0, None], [1, 1, 1]))
    assert g["sampled"] == 1.0 and g["sampled_questions"] == 1 and g["greedy_questions"] == 2
    assert paired_gain({"accuracy": 0.3}, _eval([1.0], [1])) is None  # a checkpoint written before the lists
    assert paired_gain(_eval([0.5, 0.5], [1, 1]), _eval([0.5], [1])) is None  # not the same questions
    assert paired_gain(_eval([None], [None]), _eval([None], [None])) is None


def test_the_lists_stay_out_of_metrics_rows():
    ev = _eval([0.5], [1])
    assert without_per_question(ev) == {"accuracy": 0.0}


def test_the_printed_gain_names_its_error_and_how_many_errors_it_is():
    lines = gain_lines({"sampled": 0.071, "sampled_se": 0.0142, "sampled_questions": 1000,
                        "greedy": -0.01, "greedy_se": 0.0, "greedy_questions": 1000})
    assert lines[0].startswith("held-out gain, sampled (paired SE)") and "+0.071 ± 0.014 = +5.0 SE" in lines[0]
    assert "over 1000 questions" in lines[0]
    assert "-0.010 ± 0.000" in lines[1] and "SE" not in lines[1].split("±")[1].split("over")[0]
    assert gain_lines(None) == []
