"""The launcher's child processes: where each runs (cores, priority), how it starts (as a user would start
it, `python -m exgrpo_async.launcher.cli ROLE ...`, dying with the launcher), how it is stopped, and what
its exit code says."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

log = logging.getLogger("exgrpo_async.launcher.train")
GRACE_S = 20.0


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: Ctrl-C still reaches the whole process group
        pass


def placement(cores: list[int], num_actors: int, pin: bool, per_actor: int = 1) -> tuple[set[int] | None, list[list[int] | None]]:
    """(the learner's cores, each local actor's cores); None leaves placement to the OS. Actors take
    `per_actor` cores each (a tensor-parallel CPU engine: one per worker) from core 0 up, round robin
    if there are more actors than cores, and the cores left over go to the learner, so training never
    steals an actor's core; one core, or `pin=False`, pins nothing."""
    if not pin or len(cores) < 2:
        return None, [None] * num_actors
    if num_actors and per_actor > len(cores):  # train.py check_cpu_node says so first
        raise ValueError(f"actor.engine.tensor_parallel_size={per_actor} on CPU needs a core per worker; "
                         f"this machine gives {len(cores)}")
    used = num_actors * per_actor
    spare = set(cores[used:]) if len(cores) > used > 0 else None
    slots = len(cores) // per_actor
    return spare, [cores[(i % slots) * per_actor:(i % slots + 1) * per_actor] for i in range(num_actors)]


def gpu_core_slices(cores: list[int], num_actors: int, pin: bool) -> tuple[set[int] | None, list[list[int] | None]]:
    """CPU cores for a GPU run: each actor an equal contiguous slice of the node's cores (its vLLM engine
    core, TP workers and verifier workers all run there), the learner the first slice and what does not
    divide. A GPU actor pinned to one core would share it with all of those, and its verifier would run
    out of its deadline (rewards silently 0). Fewer cores than processes, or `pin=False`: no pinning."""
    if not pin or num_actors == 0 or len(cores) < num_actors + 1:
        return None, [None] * num_actors
    k = len(cores) // (num_actors + 1)
    return set(cores[:k]) | set(cores[(num_actors + 1) * k:]), [cores[(i + 1) * k:(i + 2) * k] for i in range(num_actors)]


def child_setup(cores: set[int] | None = None, nice: int = 0) -> Callable[[], None]:
    """What a child runs before its program: die with the launcher, its cores, its priority."""
    def setup() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)
        if nice:
            os.nice(nice)

    return setup


def spawn(args: list[str], env: dict, cores: set[int] | None = None, nice: int = 0) -> subprocess.Popen:
    """`exgrpo-async ARGS...` as a child of this process."""
    return subprocess.Popen([sys.executable, "-m", "exgrpo_async.launcher.cli", *args], env=env,
                            preexec_fn=child_setup(cores, nice))


def learner_rank_envs(env: dict, world_size: int) -> list[dict]:
    """The environment of each learner rank on this machine, as torchrun would set it (a free port on
    127.0.0.1 for the rendezvous); world size 1 gets none of it."""
    if world_size == 1:
        return [env]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(world_size)]


def teardown(children: list[subprocess.Popen], wait_first: bool) -> int:
    """Let children finish on their own (when the learner ended normally), then SIGTERM, then SIGKILL.
    The first child's exit code."""
    deadline = time.monotonic() + (GRACE_S if wait_first else 0.0)
    while wait_first and time.monotonic() < deadline and any(c.poll() is None for c in children):
        time.sleep(0.2)
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    return children[0].returncode if children else 1


def exit_description(code: int | None) -> str:
    """'code 1', or 'signal 9 (SIGKILL)' for a negative Popen return code."""
    if code is not None and code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def judge_ranks(lead_rc: int, follower_rcs: list[int | None]) -> int:
    """The run's code from every learner rank's, whenever each ended: a follower that failed fails a run
    whose lead succeeded (each failed rank logged by number with its code or signal)."""
    rc = lead_rc
    for k, code in enumerate(follower_rcs, 1):
        if code not in (0, None):
            log.error("learner rank %d exited with %s", k, exit_description(code))
            if rc == 0:
                rc = 1
    return rc
