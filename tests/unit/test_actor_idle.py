"""The learner's actor-idle figure is a window between two snapshots of the actors' busy seconds."""

from learner.peers import actor_idle_share


def test_window_not_lifetime():
    # actor-1 idled 10 s before the window (engine start-up), then generated all of it
    before = {"actor-1": (0.0, 10.0)}
    now = {"actor-1": (5.0, 15.0)}
    assert actor_idle_share(before, now) == 0.0


def test_summed_over_actors():
    before = {"actor-1": (0.0, 0.0), "actor-2": (0.0, 0.0)}
    now = {"actor-1": (4.0, 4.0), "actor-2": (1.0, 4.0)}
    assert abs(actor_idle_share(before, now) - 3.0 / 8.0) < 1e-12


def test_actor_new_in_window_is_left_out():
    before = {"actor-1": (2.0, 2.0)}
    now = {"actor-1": (3.0, 4.0), "actor-2": (0.0, 4.0)}  # actor-2 joined: no window for it yet
    assert abs(actor_idle_share(before, now) - 0.5) < 1e-12


def test_no_window_yet_and_restarted_counter():
    assert actor_idle_share({}, {"actor-1": (1.0, 1.0)}) is None
    # a rejoined actor whose counter restarted contributes no busy time, never a negative one
    assert actor_idle_share({"actor-1": (9.0, 0.0)}, {"actor-1": (1.0, 2.0)}) == 1.0
