"""Two "nodes" on this machine run the SLURM recipe's commands (ops/make-keys, ops/slurm/node.sh) for real.

Node 0 and node 1 are separate process trees (each its own session, as srun starts them on two hosts)
with separate folders (EXGRPO_OUT, working directory), sharing only what a cluster's shared filesystem
holds: the key folder, the toy policy and the Prometheus targets folder. The learner has two ranks, one
per node, joined by torchrun's static rendezvous at the head address (gloo between them); node 1 also
runs one actor that joins over CurveZMQ with node 1's own client keys (clients/node1) and serves its
/metrics on every interface, advertised as 127.0.0.2 ("node 1's address"). The run must finish its
steps with every question accounted for, the actor must have been scraped at its advertised address,
and node 1 must have written nothing into node 0's folder (or anywhere but its own).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from exgrpo_async.config_io import load_config
from exgrpo_async.runs import resolve_toy
from tests.integration.helpers import children_of

pytestmark = pytest.mark.slow  # two nodes' learner ranks and an actor: 2-4 min

ROOT = Path(__file__).resolve().parents[2]
NODE_SH = ROOT / "ops" / "slurm" / "node.sh"
STEPS = 4


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def make_keys(*args: str) -> None:
    subprocess.run([str(ROOT / "ops" / "make-keys"), *args], check=True, capture_output=True,
                   env=dict(os.environ, PYTHON=sys.executable))


def stop(proc: subprocess.Popen) -> None:
    """Stop a node still running: SIGTERM to node.sh (it forwards it to torchrun, which stops its ranks,
    and to the actors), then SIGKILL whatever is left of its tree (torchrun's ranks have sessions of
    their own, so the tree, not the process group)."""
    if proc.poll() is not None:
        return
    tree = {pid: _cmdline(pid) for pid in children_of(proc.pid)}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid, cmd in tree.items():
        if cmd and _cmdline(pid) == cmd:  # still that process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def scrape_actor_target(targets: Path) -> tuple[str, str] | None:
    """(the actor's advertised address, its /metrics text), once the learner lists an actor."""
    try:
        groups = json.loads(targets.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    actors = [g["targets"][0] for g in groups if g["labels"]["role"] == "actor"]
    if not actors:
        return None
    try:
        return actors[0], urllib.request.urlopen(f"http://{actors[0]}/metrics", timeout=5).read().decode()
    except OSError:
        return None


def test_two_nodes_learner_ranks_and_an_actor_over_curve(small, tmp_path):
    resolve_toy(load_config(None, small))  # the toy policy, built once per session (a model folder on shared disk)
    shared = tmp_path / "shared"  # what the cluster's shared filesystem would hold
    keys = shared / "keys"
    make_keys(str(keys))  # exgrpo.sbatch, before srun
    make_keys(str(keys), "--client", "node1")
    zmq_port, store_port, rdzv_port, metrics_port = free_ports(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXGRPO_")) and k != "CUDA_VISIBLE_DEVICES"}
    common = dict(env, PYTHON=sys.executable, TORCHRUN=str(Path(sys.executable).parent / "torchrun"),
                  SLURM_NNODES="2", SLURM_JOB_ID="4242", EXGRPO_RUN_NAME="mn", EXGRPO_HEAD_ADDR="127.0.0.1",
                  EXGRPO_LEARNER_NODES="2", EXGRPO_GPUS_PER_NODE="0", EXGRPO_LEARNER_PROCS_PER_NODE="1",
                  EXGRPO_KEYS=str(keys), EXGRPO_SD_DIR=str(shared / "targets"), EXGRPO_ZMQ_PORT=str(zmq_port),
                  EXGRPO_STORE_PORT=str(store_port), EXGRPO_RDZV_PORT=str(rdzv_port),
                  EXGRPO_METRICS_PORT=str(metrics_port), EXGRPO_ACTOR_GRACE_S="30")
    nodes = {0: dict(EXGRPO_ACTORS_PER_NODE="0"), 1: dict(EXGRPO_ACTORS_PER_NODE="1", EXGRPO_NODE_ADDR="127.0.0.2")}
    args = [*small, f"learner.max_steps={STEPS}", "transport.heartbeat_s=0.5", "data.eval_file=none"]
    procs, logs = {}, {}
    try:
        for n, extra in nodes.items():
            home = tmp_path / f"node{n}"  # this node's own disk: its working directory and EXGRPO_OUT
            home.mkdir()
            logs[n] = home / "node.log"
            procs[n] = subprocess.Popen(["bash", str(NODE_SH), *args], cwd=home, start_new_session=True,
                                        env=dict(common, SLURM_NODEID=str(n), EXGRPO_OUT=str(home), **extra),
                                        stdout=open(logs[n], "w"), stderr=subprocess.STDOUT)
        run_dir = tmp_path / "node0" / "node-0" / "mn"
        scraped = None
        deadline = time.monotonic() + 300
        while any(p.poll() is None for p in procs.values()):
            assert time.monotonic() < deadline, "the two nodes did not finish in time"
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            assert not failed, f"node {failed[0]} exited with {procs[failed[0]].returncode}"
            scraped = scraped or scrape_actor_target(run_dir / "prometheus-targets.json")
            time.sleep(0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n" + "\n".join(f"--- node {n}:\n{logs[n].read_text()[-3000:]}" for n in logs)) from None
    finally:
        for p in procs.values():
            stop(p)
    assert [p.returncode for p in procs.values()] == [0, 0], [logs[n].read_text()[-3000:] for n in logs]

    # the run: every step once, every question accounted for, the actor's work in it
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # and no evaluation rows: it was off
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["questions_unaccounted"] == 0
    assert summary["questions_trained"] == STEPS * 8 and summary["actors_joined"] == 1
    assert summary["syncs"] >= 2  # version 0 and at least one newer one reached the actor by broadcast
    config = json.loads((run_dir / "config.json").read_text())
    assert config["learner"]["world_size"] == 2  # one rank per node
    assert config["transport"]["curve_keys_dir"] == str(keys)  # curve server: only authorized keys get in

    # the actor joined over CurveZMQ with node 1's client keys, and was scraped where it said it was
    node1 = logs[1].read_text()
    assert f"with keys {keys / 'clients' / 'node1'}" in node1
    assert "joined from" in logs[0].read_text()
    assert scraped is not None, "no actor target was ever listed and reachable"
    address, text = scraped
    assert address.startswith("127.0.0.2:") and "exgrpo_actor_policy_version" in text
    assert json.loads((run_dir / "prometheus-targets.json").read_text()) == []  # the run is over
    assert not list((shared / "targets").iterdir())  # and has left the shared SD folder

    # each node wrote only in its own folder: node 1 has its actor's log, no run folder
    assert sorted(p.name for p in (tmp_path / "node1").iterdir()) == ["node-1", "node.log"]
    assert sorted(p.name for p in (tmp_path / "node1" / "node-1").iterdir()) == ["actor-0.log"]
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["node-0", "node.log"]
    assert sorted(p.name for p in (tmp_path / "node0" / "node-0").iterdir()) == ["mn"]
