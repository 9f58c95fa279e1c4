"""ops/bench/learning/learning.py's pure parts: the larger held-out set's draw, its arms' overrides, the per-seed table."""

from __future__ import annotations

import pytest

from exgrpo_async.toy.task import TEST_KINDS
from tests.bench import load_bench

learning = load_bench("learning/learning")


def test_heldout_draw_is_fixed_distinct_and_apart_from_the_pool():
    first = learning.draw_heldout(30, set())
    exclude = {r["problem"] for r in first[::2]}  # every other question, as if in a training pool
    second = learning.draw_heldout(30, exclude)
    assert [r["kind"] for r in second] == [k for k in TEST_KINDS for _ in range(30)]
    problems = [r["problem"] for r in second]
    assert len(set(problems)) == len(problems) and not exclude & set(problems)
    assert learning.draw_heldout(30, exclude) == second  # the same draw every time
    assert all(eval(r["problem"].rstrip("=")) == int(r["answer"]) for r in second)


def test_heldout_draw_refuses_a_kind_it_cannot_fill():
    # mul21 has 90 x 8 = 720 questions: asking for more cannot be met apart from nothing
    with pytest.raises(ValueError, match="only 720 mul21"):
        learning.draw_heldout(721, set())


@pytest.mark.parametrize("name", sorted(learning.ARMS))
def test_every_arm_loads_and_sets_what_it_names(name):
    # a typo in an arm surfaces here, not an hour into a bench invocation as a failed run
    from exgrpo_async.config_io import load_config, parse_override_value

    for scenario in learning.SCENARIOS:
        cfg = load_config(None, [*learning.SCENARIOS[scenario], *learning.ARMS[name]])
        for item in learning.ARMS[name]:
            key, text = item.split("=", 1)
            section, field = key.split(".")
            want = parse_override_value(text)
            assert getattr(getattr(cfg, section), field) == (None if want == "none" else want), item


def test_seed_table_groups_runs_of_any_arm_by_seed_at_the_shortest_budget():
    # seed 0: two arms, read at 100 tokens (the second run, longer, is interpolated there); seed 1: one run
    runs = [{"arm": "a", "seed": 0, "points": [[0, 0.30, 0.5], [100, 0.40, 0.5]]},
            {"arm": "b", "seed": 0, "points": [[0, 0.30, 0.5], [200, 0.70, 0.5]]},
            {"arm": "a", "seed": 1, "points": [[0, 0.20, 0.5], [100, 0.25, 0.5]]}]
    rows = learning.seed_table(runs, 100, 50).splitlines()[2:]
    assert rows == ["| 0 | 2 | 0.300 | 0.450 ± 0.071 | +15.0 ± 7.1 |",
                    "| 1 | 1 | 0.200 | 0.250 ± 0.000 | +5.0 ± 0.0 |"]
