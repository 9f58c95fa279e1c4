"""Where `exgrpo-async train` puts its processes: an actor per core, the learner on the cores left over."""

from exgrpo_async.launch import placement


def test_actors_first_learner_gets_the_rest():
    assert placement([0, 1, 2, 3], 2, True) == ({2, 3}, [0, 1])


def test_no_spare_core_leaves_the_learner_unpinned():
    assert placement([0, 1], 2, True) == (None, [0, 1])
    assert placement([0, 1], 3, True) == (None, [0, 1, 0])  # more actors than cores: round robin


def test_pinning_off_or_one_core():
    assert placement([0, 1, 2, 3], 2, False) == (None, [None, None])
    assert placement([5], 1, True) == (None, [None])
