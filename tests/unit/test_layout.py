"""The layout chosen from the machine (exgrpo_async/layout.py): how many actors and learner threads a run
gets when the config leaves them unset, what the planner makes of it on GPU nodes, and the balance
line the summary prints from measured idle shares."""

import os

import pytest

from exgrpo_async.config_io import load_config
from exgrpo_async.launcher.placement import plan
from exgrpo_async.layout import balance, idle_medians, resolve


def _cfg(*extra):
    return load_config(None, list(extra))


@pytest.mark.parametrize("cores,tp,world,actors,threads", [
    (1, 1, 1, 1, 1),  # one core: one actor, the learner shares it
    (2, 1, 1, 2, 1),  # the demo's machine: an actor per core, a 1-thread learner over them
    (3, 1, 1, 3, 1),
    (8, 1, 1, 8, 4),
    (16, 1, 2, 16, 4),  # two learner ranks share half the cores
    (8, 2, 1, 4, 4),  # TP-2 CPU actors: 2 cores each
    (2, 2, 1, 1, 1),  # one TP-2 actor takes both cores
])
def test_a_cpu_layout_splits_the_cores_between_generating_and_training(cores, tp, world, actors, threads):
    cfg = resolve(_cfg(f"actor.engine.tensor_parallel_size={tp}", f"learner.world_size={world}"), cores, 0)
    assert (cfg.actor.num_actors, cfg.learner.threads) == (actors, threads)


def test_what_the_config_sets_is_kept():
    cfg = resolve(_cfg("actor.num_actors=3", "learner.threads=5"), 2, 0)
    assert (cfg.actor.num_actors, cfg.learner.threads) == (3, 5)
    cfg = resolve(_cfg("actor.num_actors=0"), 4, 0)
    assert (cfg.actor.num_actors, cfg.learner.threads) == (0, 2)


@pytest.mark.parametrize("gpus,world,tp,actors", [(2, 1, 1, 1), (8, 1, 1, 7), (8, 4, 2, 2), (8, 2, 4, 1)])
def test_on_gpus_every_gpu_the_learner_leaves_generates(gpus, world, tp, actors):
    cfg = _cfg(f"learner.world_size={world}", f"actor.engine.tensor_parallel_size={tp}")
    assert resolve(cfg, 16, gpus).actor.num_actors == actors
    p = plan(cfg, gpus)  # the planner resolves an unset count the same way
    assert len(p.actors) == actors and all(len(g) == tp for g in p.actors)


def test_a_gpu_node_with_no_gpu_left_for_an_actor_is_refused():
    with pytest.raises(ValueError, match="no GPU left for an actor"):
        resolve(_cfg(), 16, 1)
    assert resolve(_cfg("actor.num_actors=0"), 16, 1).actor.num_actors == 0


@pytest.mark.parametrize("learner,actor,verdict", [
    (0.0, 0.46, "learner-bound"), (0.40, 0.02, "generation-bound"), (0.10, 0.12, "balanced"), (None, 0.5, "not measured"),
])
def test_balance_says_which_side_to_give_more(learner, actor, verdict):
    assert verdict in balance(learner, actor)


def test_idle_medians_leave_out_the_start():
    idle = {"learner": [0.9] * 5 + [0.1, 0.2, 0.3], "actor": [0.0] * 5 + [0.5, 0.4, 0.6],
            "cores": [0.5] * 5 + [0.97, 0.99, 0.98]}
    assert idle_medians(idle) == {"learner_idle_median": 0.2, "actor_idle_median": 0.5, "cores_busy_median": 0.98}
    assert idle_medians({"learner": [], "actor": []}) == {"learner_idle_median": None, "actor_idle_median": None,
                                                         "cores_busy_median": None}


def test_the_balance_line_shows_the_cores_busy_share():
    assert "CPU cores busy 97%" in balance(0.27, 0.08, 0.97)
    assert "busy" not in balance(0.27, 0.08)


def test_the_balance_line_says_when_full_cores_leave_nothing_to_move():
    assert "only shifts the idle time" in balance(0.17, 0.14, 0.98)
    assert "only shifts the idle time" in balance(0.02, 0.40, 0.96)
    assert "only shifts" not in balance(0.17, 0.14, 0.80)  # idle cores: the move is real
    assert "only shifts" not in balance(0.10, 0.10, 0.99)  # balanced: nothing to move


def test_the_core_clock_sees_a_busy_core():
    """A spinning process on one of this process's cores makes that core's clock read busy."""
    import multiprocessing as mp
    import time

    from exgrpo_async.layout import CoreClock

    core = sorted(os.sched_getaffinity(0))[0]
    clock = CoreClock()
    clock.cores = [core]
    clock.busy_since_last()
    stop = mp.get_context("spawn").Event()
    spin = mp.get_context("spawn").Process(target=_spin, args=(core, stop))
    spin.start()
    try:
        time.sleep(1.5)
        clock.busy_since_last()  # the spinner's start-up is left out
        time.sleep(1.0)
        assert clock.busy_since_last() > 0.9
    finally:
        stop.set()
        spin.join()


def _spin(core: int, stop) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        pass
