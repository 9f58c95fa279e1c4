"""The run's layout chosen from the machine: how many local actors generate and how many threads train.

`actor.num_actors` and `learner.threads` left unset (None) are filled in by `resolve` before `train`
writes the run's config.json, so the run folder records what was chosen:
- CPU: every core generates and the learner trains on half of them. Each actor takes
  `actor.engine.tensor_parallel_size` cores (a core per vLLM worker) and runs `actor.nice` nicer than
  the learner, so the learner, whose step is the critical path, takes its cores whenever it trains
  and the actors every cycle it leaves: cores lent from the idle side to the busy one as the run goes.
  On the toy task on 2 cores (2 actors, a 1-thread learner, 16 questions per request) the learner
  idles 23% and the actors 10%, against 53% learner idle with 1 actor and a core each, and a learner
  at half speed with 2 actors of equal priority (docs/benchmarks.md "Where the learner's step goes").
- GPU: every GPU the learner's ranks do not take generates, one tensor-parallel group per actor.
`balance` reads a run's measured idle shares and says which side to give more (the summary prints it),
so a user moves cores or GPUs from the idle side to the busy one on the next run. On CPU the two sides
share cores, so a side's idle share is not idle hardware: `CoreClock` measures how busy the run's
cores were (by anyone), and the balance line says when one side's idle time went to the other.
"""

from __future__ import annotations

import os

import psutil

from exgrpo_async.config import RunConfig


class PlacementError(ValueError):
    """A layout or GPU plan that cannot run; the message says why (`train` prints it and exits 2)."""


IDLE_TARGET = 0.15  # an idle share above this on one side, with the other side busy, is worth a move
CORES_FULL = 0.95  # cores this busy have no idle time to lend (docs/benchmarks.md, "Stale drops": the arithmetic)


def resolve(cfg: RunConfig, cores: int, gpus: int) -> RunConfig:
    """`cfg` with `actor.num_actors` and `learner.threads` set from the machine where they are None
    (`cores`: CPU cores this process may use; `gpus`: GPUs `train` places processes on, 0 on CPU)."""
    A, L = cfg.actor, cfg.learner
    if A.num_actors is not None and L.threads is not None:
        return cfg
    cfg = cfg.model_copy(deep=True)
    tp = A.engine.tensor_parallel_size
    if cfg.actor.num_actors is None:
        if gpus:
            cfg.actor.num_actors = max(0, gpus - L.world_size) // tp
            if cfg.actor.num_actors == 0:
                raise PlacementError(f"no GPU left for an actor of TP {tp}: the node has {gpus} and the learner takes "
                                 f"{L.world_size}; set actor.num_actors=0 to run the learner alone (actors then "
                                 "join with `exgrpo-async actor`)")
        else:
            cfg.actor.num_actors = max(1, cores // tp)
    if cfg.learner.threads is None:
        cfg.learner.threads = max(1, (cores // 2) // L.world_size)
    return cfg


def standalone_threads(cfg: RunConfig) -> int:
    """The learner's torch threads outside `train` (its own process, e.g. under torchrun): the configured
    ones, else this process's cores shared by the ranks on this node."""
    if cfg.learner.threads is not None:
        return cfg.learner.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // local)


class CoreClock:
    """How busy this process's CPU cores (its affinity: on `train`'s CPU layout, the run's cores) were
    between two calls, from the kernel's per-core counters: 1 - idle / elapsed, whoever ran."""

    def __init__(self) -> None:
        self.cores = sorted(os.sched_getaffinity(0))
        self._last = self._read()

    def _read(self) -> tuple[float, float]:
        per_core = psutil.cpu_times(percpu=True)
        times = [per_core[c] for c in self.cores if c < len(per_core)]
        idle = sum(t.idle + getattr(t, "iowait", 0.0) for t in times)
        return sum(sum(t) for t in times), idle

    def busy_since_last(self) -> float | None:
        """The cores' busy share since the previous call (None when no time was counted)."""
        (total, idle), (total0, idle0) = self._read(), self._last
        self._last = (total, idle)
        elapsed = total - total0
        return None if elapsed <= 0 else min(1.0, max(0.0, 1.0 - (idle - idle0) / elapsed))


def balance(learner_idle: float | None, actor_idle: float | None, cores_busy: float | None = None) -> str:
    """One line on the run's balance from the median idle shares of its steps, and which way to move;
    with the cores' busy share when measured (on shared CPU cores one side's idle time is the other's)."""
    if learner_idle is None or actor_idle is None:
        return "balance: not measured (too few steps)"
    line = f"balance: learner idle {learner_idle:.0%}, actors idle {actor_idle:.0%}"
    if cores_busy is not None:
        line += f", CPU cores busy {cores_busy:.0%}"
    full = "" if cores_busy is None or cores_busy < CORES_FULL else (
        "; on a CPU run the sides share these cores, now full, so a move only shifts the idle time: more "
        "cores, or less work per step on the busy side, would shorten the step")
    if actor_idle > IDLE_TARGET and actor_idle > learner_idle:
        return line + ": learner-bound; give the learner more (fewer actors, more learner threads or GPUs)" + full
    if learner_idle > IDLE_TARGET and learner_idle > actor_idle:
        return line + ": generation-bound; give the actors more (more actors, cores or GPUs)" + full
    return line + ": balanced"


def idle_medians(idle: dict[str, list[float]], skip: int = 5) -> dict[str, float | None]:
    """The summary's median idle shares of the learner and the actors (and the cores' busy share), over
    the steps after the first `skip` (start-up: the first batches are generated while the learner has
    nothing to train)."""
    def median(xs: list[float]) -> float | None:
        xs = sorted(xs[skip:] if len(xs) > skip else xs)
        return xs[len(xs) // 2] if xs else None

    return {"learner_idle_median": median(idle["learner"]), "actor_idle_median": median(idle["actor"]),
            "cores_busy_median": median(idle.get("cores", []))}
