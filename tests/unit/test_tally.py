"""The server's `Tally`: per-step values for the training loop, running totals for the summary, and no
per-sync history kept however long the run."""

from __future__ import annotations

from learner.peers import Tally


def test_tally_hands_out_new_values_once_and_keeps_only_totals():
    t = Tally(keep=3)
    assert t.mean() is None and t.take() == []
    for x in (1.0, 2.0, 3.0, 4.0, 5.0):
        t.add(x)
    assert t.take() == [1.0, 2.0, 3.0]  # at most `keep` between two takes
    assert t.take() == []
    t.add(10.0)
    assert t.take() == [10.0]
    assert (t.count, t.total, t.mean()) == (6, 25.0, 25.0 / 6)
