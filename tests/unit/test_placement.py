"""Where `exgrpo-async train` puts its processes: on CPU an actor per core and the learner on the cores left
over (`launch.placement`); on a GPU node disjoint GPU sets from the planner (`exgrpo_async.launcher.placement.plan`)
on nodes of 1, 2, 4 and 8 GPUs (no GPU needed), and `train --dry-run`."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from exgrpo_async.config_io import load_config
from exgrpo_async.launcher.placement import PlacementError, plan
from exgrpo_async.launcher.processes import child_setup, placement

REPO = Path(__file__).resolve().parents[2]


def _cfg(world=1, actors=1, tp=1, *extra):
    return load_config(None, [f"learner.world_size={world}", f"actor.num_actors={actors}",
                              f"actor.engine.tensor_parallel_size={tp}", *extra])


@pytest.mark.parametrize("gpus,world,actors,tp,learner,groups", [
    (1, 1, 0, 1, [0], []),
    (2, 1, 1, 1, [0], [[1]]),
    (4, 2, 1, 2, [0, 1], [[2, 3]]),
    (8, 4, 2, 2, [0, 1, 2, 3], [[4, 5], [6, 7]]),
    (8, 1, 7, 1, [0], [[i] for i in range(1, 8)]),
])
def test_default_plan_puts_the_learner_first_then_the_actors(gpus, world, actors, tp, learner, groups):
    p = plan(_cfg(world, actors, tp), gpus)
    assert p.learner == learner and p.actors == groups
    assert "learner" in p.table()


def test_explicit_lists_are_taken_as_given():
    p = plan(_cfg(2, 2, 2, "placement.learner_gpus=[6,7]", "placement.actor_gpus=[[0,1],[2,3]]"), 8)
    assert p.learner == [6, 7] and p.actors == [[0, 1], [2, 3]]
    assert "unused: GPUs 4,5" in p.table()


@pytest.mark.parametrize("gpus,args,why", [
    (1, (1, 1, 1), "need 1 GPUs besides"),  # the learner takes the only GPU
    (4, (2, 2, 2), "need 4 GPUs besides"),
    (8, (2, 1, 2, "placement.actor_gpus=[[2,3,4]]"), "gets 3 GPUs but"),  # TP 2 given 3 GPUs
    (8, (2, 1, 2, "placement.actor_gpus=[[1,2]]"), "more than one process"),  # overlaps the learner's GPU 1
    (4, (1, 1, 1, "placement.learner_gpus=[5]"), "do not exist"),
    (8, (2, 1, 1, "placement.learner_gpus=[0]"), "learner.world_size is 2"),
    (8, (1, 2, 1, "placement.actor_gpus=[[1]]"), "actor.num_actors is 2"),
])
def test_bad_plans_are_clear_errors(gpus, args, why):
    with pytest.raises(PlacementError, match=why):
        plan(_cfg(*args), gpus)


def test_a_cpu_run_has_no_plan():
    assert plan(_cfg(2, 2, 1), 0) is None


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*-8gpu.toml")))
def test_dry_run_prints_the_placement_of_each_shipped_config_quickly(config):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "train", "--config", str(config), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "node: 8 GPUs" in proc.stdout and "learner (" in proc.stdout and "actor 1 (TP" in proc.stdout
    assert time.time() - t0 < 5


def test_train_refuses_a_bad_plan_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "train", "placement.gpus=2", "learner.world_size=2",
                           "actor.num_actors=1", f"output_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 2 and "placement:" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run folder, no toy build, no process


def test_actors_first_learner_gets_the_rest():
    assert placement([0, 1, 2, 3], 2, True) == ({2, 3}, [[0], [1]])


def test_no_spare_core_leaves_the_learner_unpinned():
    assert placement([0, 1], 2, True) == (None, [[0], [1]])
    assert placement([0, 1], 3, True) == (None, [[0], [1], [0]])  # more actors than cores: round robin


def test_pinning_off_or_one_core():
    assert placement([0, 1, 2, 3], 2, False) == (None, [None, None])
    assert placement([5], 1, True) == (None, [None])


def test_tensor_parallel_cpu_actors_get_a_core_per_worker():
    assert placement([0, 1, 2, 3, 4], 2, True, per_actor=2) == ({4}, [[0, 1], [2, 3]])
    assert placement([0, 1], 1, True, per_actor=2) == (None, [[0, 1]])
    assert placement([0, 1, 2, 3], 3, True, per_actor=2) == (None, [[0, 1], [2, 3], [0, 1]])
    with pytest.raises(ValueError, match="core per worker"):
        placement([0, 1], 1, True, per_actor=3)
    assert placement([0, 1], 0, True, per_actor=4) == (None, [])  # no local actor: nothing to place


@pytest.mark.parametrize("override, why", [
    ("learner.device=cuda", "learner.device='cuda' but this node has no GPU; use 'cpu' or 'auto'"),
    ("weight_sync.backend=nccl", "weight_sync.backend='nccl' needs GPUs and this node has none; use 'gloo' or 'auto'"),
    ("actor.engine.tensor_parallel_size=3", "actor.engine.tensor_parallel_size=3 on CPU needs a core per worker; "
                                            "this machine gives 2"),
])
def test_what_a_node_without_gpus_cannot_run_is_refused_up_front(override, why):
    """Before: the learner's traceback after its start (7 s), every actor's, restarts used up (56 s, nccl), or
    the launcher's own traceback (tensor parallel); now a placement error before anything starts."""
    from exgrpo_async.launcher.train import check_cpu_node

    with pytest.raises(PlacementError) as e:
        check_cpu_node(load_config(None, [override]), gpus=0, cores=2)
    assert str(e.value) == why
    check_cpu_node(load_config(None, [override]), gpus=8, cores=2)  # a GPU node: the GPU plan decides
    check_cpu_node(load_config(None, [override, "actor.num_actors=0"] if "tensor" in override else []), gpus=0, cores=2)


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a node with a GPU driver")
def test_train_on_a_node_without_gpus_refuses_a_cuda_learner_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "train", "learner.device=cuda",
                           f"output_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("exgrpo-async: placement: learner.device='cuda' but this node has no GPU; use 'cpu' "
                                   "or 'auto'")
    assert not list(tmp_path.iterdir())  # no run folder, no process


def test_cpu_thread_binding_splits_the_actors_cores_between_its_workers():
    from actors.engine import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [4, 5, 6, 7]) == "4,5|6,7"
    with pytest.raises(ValueError, match="needs as many CPU cores"):
        cpu_thread_binding(2, [3])


def test_a_plan_for_more_gpus_than_the_node_shows_is_refused():
    from exgrpo_async.launcher.train import check_devices

    p = plan(_cfg(4, 2, 2), 8)
    check_devices(p, 8)
    check_devices(None, 0)  # a CPU run
    with pytest.raises(PlacementError, match="shows 1 CUDA device"):
        check_devices(p, 1)


def test_an_actor_child_runs_nicer_on_its_cores():
    import os

    code = "import os; print(os.nice(0), sorted(os.sched_getaffinity(0)))"
    core = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=child_setup({core}, 7), capture_output=True, text=True)
    assert out.stdout.split(maxsplit=1) == [str(os.nice(0) + 7), f"[{core}]\n"]


def test_a_preset_cuda_visible_devices_is_honoured():
    """Plan indices are positions among the devices `train` sees: under CUDA_VISIBLE_DEVICES=4,5,6,7 the
    learner's GPU 0 is physical GPU 4, not 0 (a scheduler's partial node)."""
    from exgrpo_async.launcher.placement import visible

    assert visible([0], None) == "0" and visible([1, 2], "") == "1,2"
    assert visible([0], "4,5,6,7") == "4" and visible([2, 3], "4,5,6,7") == "6,7"
    assert visible([1], "GPU-aa, GPU-bb") == "GPU-bb"  # UUIDs too
    with pytest.raises(PlacementError, match="lists 2 device"):
        visible([2], "4,5")


def test_gpu_actors_get_a_real_share_of_the_cores():
    """On a GPU run each actor gets an equal slice of the node's cores (engine, TP workers and verifier
    workers share it), not one core; the learner the first slice and the remainder."""
    from exgrpo_async.launcher.processes import gpu_core_slices

    spare, actors = gpu_core_slices(list(range(64)), 7, True)
    assert actors == [list(range(8 * (i + 1), 8 * (i + 2))) for i in range(7)]
    assert spare == set(range(8))
    spare, actors = gpu_core_slices(list(range(10)), 2, True)  # 3 slices of 3, core 9 left over
    assert actors == [[3, 4, 5], [6, 7, 8]] and spare == {0, 1, 2, 9}
    assert gpu_core_slices(list(range(64)), 7, False) == (None, [None] * 7)
    assert gpu_core_slices([0, 1], 2, True) == (None, [None, None])  # fewer cores than processes


NODE_GPUS = """
import sys
from exgrpo_async.config_io import load_config
from exgrpo_async.launcher import train
train.GPU_DEVICE_FILES = (sys.argv[1],)
print(train.node_gpus(load_config(None, [])), "torch" in sys.modules)
"""


@pytest.mark.timeout(120)
def test_train_asks_torch_for_the_gpus_only_where_a_gpu_driver_is(tmp_path):
    """Without a GPU driver's device file `train` counts 0 GPUs without importing torch (seconds of a core
    before any process of the run starts); with one, torch counts them."""
    def ask(device_file: Path) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", NODE_GPUS, str(device_file)], capture_output=True, text=True,
                              timeout=100)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    assert ask(tmp_path / "no-driver") == ["0", "False"]
    (tmp_path / "nvidiactl").touch()
    import torch

    assert ask(tmp_path / "nvidiactl") == [str(torch.cuda.device_count()), "True"]
