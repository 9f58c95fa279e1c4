"""The SLURM recipe (ops/slurm/) without SLURM: exgrpo.sbatch under a fake `srun` and `scontrol`, and
node.sh with EXGRPO_DRY_RUN=1, which prints each node's commands instead of running them. What a real
run does with those commands is tests/integration/test_multinode.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH, NODE_SH = REPO / "ops" / "slurm" / "exgrpo.sbatch", REPO / "ops" / "slurm" / "node.sh"
CONFIG_7B = REPO / "configs" / "qwen2.5-math-7b-8gpu.toml"  # actor TP 2

FAKE_SRUN = """#!/usr/bin/env bash
# srun for tests: runs the command once per node, one after the other, with SLURM_NODEID set
while [ $# -gt 0 ]; do
  case "$1" in --nodes) n=$2; shift 2;; --ntasks-per-node) shift 2;; --*) shift;; *) break;; esac
done
names=(gpu-a gpu-b gpu-c)
for ((k = 0; k < n; k++)); do SLURM_NODEID=$k SLURMD_NODENAME=${names[k]} "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' gpu-a gpu-b gpu-c
"""


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def _env(tmp_path, bin_dir, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXGRPO_", "CUDA_VISIBLE"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=sys.executable, EXGRPO_DRY_RUN="1", SLURM_JOB_ID="99",
               SLURM_NNODES="3", SLURM_JOB_NODELIST="gpu-[a-c]", SLURM_SUBMIT_DIR=str(REPO),
               EXGRPO_OUT=str(tmp_path / "job"), EXGRPO_SD_DIR=str(tmp_path / "targets"), **extra)
    return env


def _commands(stdout: str) -> list[list[str]]:
    """The command lines node.sh printed: `env ... torchrun ...` (learner), `CUDA_VISIBLE_DEVICES=... actor`."""
    return [shlex.split(line) for line in stdout.splitlines() if line.startswith(("env ", "CUDA_VISIBLE_DEVICES="))]


def test_sbatch_makes_keys_and_starts_learner_nodes_then_actor_nodes(tmp_path, bin_dir):
    env = _env(tmp_path, bin_dir, EXGRPO_HEAD_ADDR="10.1.2.3", EXGRPO_LEARNER_NODES="2", EXGRPO_GPUS_PER_NODE="8",
               EXGRPO_CONFIG=str(CONFIG_7B), CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    proc = subprocess.run(["bash", str(SBATCH), "learner.max_steps=7"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    keys = tmp_path / "job" / "keys"
    assert (keys / "server.key_secret").exists()
    assert sorted(p.name for p in (keys / "clients").iterdir()) == ["node1", "node2"]
    assert sorted(p.name for p in (keys / "authorized_clients").iterdir()) == ["client.key", "node1.key", "node2.key"]
    assert f"{tmp_path / 'targets'}/slurm-99.json" in proc.stdout  # where Prometheus finds the targets
    cmds = _commands(proc.stdout)
    learners = [c for c in cmds if c[0] == "env"]
    actors = [c for c in cmds if c[0] != "env"]
    assert len(learners) == 2 and len(actors) == 4  # 8 GPUs / TP 2 on the one actor node
    for node, c in enumerate(learners):
        assert c[c.index("--node-rank") + 1] == str(node) and c[c.index("--nnodes") + 1] == "2"
        assert c[c.index("--rdzv-backend") + 1] == "static" and c[c.index("--rdzv-endpoint") + 1] == "10.1.2.3:29512"
        for override in ("learner.world_size=16", "transport.host=10.1.2.3", "transport.port=29510",
                         "weight_sync.port=29511", f"transport.curve_keys_dir={keys}", "metrics.actor_host=0.0.0.0",
                         f"metrics.sd_dir={tmp_path / 'targets'}"):
            assert override in c
        assert c[-1] == "learner.max_steps=7"  # the command line's overrides come last: they win
        assert c[c.index("--run-dir") + 1] == str(tmp_path / "job" / f"node-{node}" / "slurm-99")  # own folder
    assert sorted(c[0] for c in actors) == [f"CUDA_VISIBLE_DEVICES={g}" for g in ("0,1", "2,3", "4,5", "6,7")]
    for c in actors:
        assert c[c.index("--learner") + 1] == "tcp://10.1.2.3:29510"
        assert c[c.index("--keys") + 1] == str(keys / "clients" / "node2")
        assert c[c.index("--advertise-host") + 1] == "gpu-c"  # the node's name, for Prometheus


def test_learner_and_actors_share_a_node(tmp_path, bin_dir):
    """4 of 8 GPUs for the learner rank(s), the other 4 for TP-2 actors."""
    env = _env(tmp_path, bin_dir, EXGRPO_HEAD_ADDR="10.1.2.3", EXGRPO_GPUS_PER_NODE="8", SLURM_NODEID="0",
               EXGRPO_LEARNER_PROCS_PER_NODE="4", EXGRPO_CONFIG=str(CONFIG_7B), CUDA_VISIBLE_DEVICES="7,6,5,4,3,2,1,0",
               EXGRPO_KEYS=str(tmp_path / "keys"))
    subprocess.run([str(REPO / "ops" / "make-keys"), str(tmp_path / "keys")], env=env, check=True, capture_output=True)
    proc = subprocess.run(["bash", str(NODE_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    (learner,) = [c for c in cmds if c[0] == "env"]
    assert "CUDA_VISIBLE_DEVICES=7,6,5,4" in learner and "learner.world_size=4" in learner
    assert learner[learner.index("--nproc-per-node") + 1] == "4"
    actors = [c for c in cmds if c[0] != "env"]
    assert sorted(c[0] for c in actors) == ["CUDA_VISIBLE_DEVICES=1,0", "CUDA_VISIBLE_DEVICES=3,2"]
    assert all(c[c.index("--advertise-host") + 1] == "10.1.2.3" for c in actors)  # node 0 is advertised as HEAD


def test_head_address_from_the_node_list_and_loopback_refused(tmp_path, bin_dir):
    env = _env(tmp_path, bin_dir)
    fake = bin_dir / "getent"  # node 0 of the list, resolved once
    fake.write_text('#!/usr/bin/env bash\n[ "$2" = gpu-a ] && echo "10.9.8.7  STREAM gpu-a"\n')
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(NODE_SH), "--head-addr"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "10.9.8.7", out.stderr
    fake.write_text('#!/usr/bin/env bash\necho "127.0.1.1  STREAM $2"\n')  # Debian's /etc/hosts entry
    out = subprocess.run(["bash", str(NODE_SH), "--head-addr"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "loopback" in out.stderr and "EXGRPO_HEAD_ADDR" in out.stderr


def test_bad_override_and_missing_keys_stop_a_node_before_it_starts(tmp_path, bin_dir):
    env = _env(tmp_path, bin_dir, EXGRPO_HEAD_ADDR="10.1.2.3", SLURM_NODEID="1", EXGRPO_KEYS=str(tmp_path / "nokeys"))
    out = subprocess.run(["bash", str(NODE_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "ops/make-keys" in out.stderr
    subprocess.run([str(REPO / "ops" / "make-keys"), str(tmp_path / "keys")], env=env, check=True, capture_output=True)
    env["EXGRPO_KEYS"] = str(tmp_path / "keys")
    out = subprocess.run(["bash", str(NODE_SH), "learner.no_such_key=1"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "no_such_key" in out.stderr
