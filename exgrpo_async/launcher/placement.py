"""Placement: which GPUs of this node each process `exgrpo-async train` starts gets.

The learner's `learner.world_size` ranks and each of the `actor.num_actors` actors
(`actor.engine.tensor_parallel_size` GPUs each) get disjoint GPU sets. Without explicit lists the
learner takes the first GPUs and the actors the next ones in order; `placement.learner_gpus` and
`placement.actor_gpus` say it explicitly. A plan that overlaps, needs more GPUs than the node has, or
gives an actor a GPU count other than its tensor-parallel size is an error before anything starts.
A CPU run (no GPUs) has no plan: processes share the cores (launcher/processes.py pins actors to cores).
`train` sets each process's CUDA_VISIBLE_DEVICES from the plan; a learner rank then uses its
LOCAL_RANK-th visible device, an actor's engine all of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from exgrpo_async.config import RunConfig
from exgrpo_async.layout import PlacementError, resolve


@dataclass(frozen=True)
class Plan:
    gpus: int  # GPUs the node offers
    learner: list[int]
    actors: list[list[int]]

    def table(self) -> str:
        rows = [f"node: {self.gpus} GPUs", f"  learner ({len(self.learner)} rank(s)): GPUs {_ids(self.learner)}"]
        rows += [f"  actor {i + 1} (TP {len(g)}): GPUs {_ids(g)}" for i, g in enumerate(self.actors)]
        idle = sorted(set(range(self.gpus)) - set(self.learner) - {x for g in self.actors for x in g})
        if idle:
            rows.append(f"  unused: GPUs {_ids(idle)}")
        return "\n".join(rows)


def _ids(gpus: list[int]) -> str:
    return ",".join(str(g) for g in gpus)


def visible(gpus: list[int], parent: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a process that gets `gpus` (indices among the devices this process sees).
    Under a preset `parent` list (a scheduler's partial node, a shared box), index i is the parent's i-th
    entry, not physical GPU i: `train` under CUDA_VISIBLE_DEVICES=4,5,6,7 gives its learner GPU 4."""
    if not parent or not parent.strip():
        return _ids(gpus)
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    if max(gpus, default=-1) >= len(entries):
        raise PlacementError(f"the plan uses GPU {max(gpus)} but CUDA_VISIBLE_DEVICES={parent!r} lists "
                             f"{len(entries)} device(s)")
    return ",".join(entries[g] for g in gpus)


def plan(cfg: RunConfig, node_gpus: int) -> Plan | None:
    """The GPU plan of a `train` run on a node with `node_gpus` GPUs (None on a CPU run)."""
    P = cfg.placement
    n = P.gpus if P.gpus is not None else node_gpus
    if n == 0:
        if P.learner_gpus or P.actor_gpus:
            raise PlacementError("placement lists GPUs but the node has none (placement.gpus=0 or no CUDA device)")
        return None
    if cfg.actor.num_actors is None:  # every GPU the learner does not take (layout.py)
        cfg = resolve(cfg, 1, n)
    world, tp, actors = cfg.learner.world_size, cfg.actor.engine.tensor_parallel_size, cfg.actor.num_actors
    learner = list(P.learner_gpus) if P.learner_gpus is not None else list(range(world))
    if len(learner) != world:
        raise PlacementError(f"placement.learner_gpus has {len(learner)} GPUs but learner.world_size is {world}")
    if P.actor_gpus is not None:
        groups = [list(g) for g in P.actor_gpus]
        if len(groups) != actors:
            raise PlacementError(f"placement.actor_gpus has {len(groups)} groups but actor.num_actors is {actors}")
    else:
        free = [g for g in range(n) if g not in learner]
        if actors * tp > len(free):
            raise PlacementError(f"{actors} actors of TP {tp} need {actors * tp} GPUs besides the learner's {world}; "
                                 f"the node has {n} (lower actor.num_actors or learner.world_size)")
        groups = [free[i * tp:(i + 1) * tp] for i in range(actors)]
    for i, g in enumerate(groups):
        if len(g) != tp:
            raise PlacementError(f"actor {i + 1} gets {len(g)} GPUs but actor.engine.tensor_parallel_size is {tp}")
    used = learner + [x for g in groups for x in g]
    bad = sorted({x for x in used if not 0 <= x < n})
    if bad:
        raise PlacementError(f"GPUs {_ids(bad)} do not exist on a node of {n} GPUs")
    twice = sorted({x for x in used if used.count(x) > 1})
    if twice:
        raise PlacementError(f"GPUs {_ids(twice)} are given to more than one process")
    return Plan(n, learner, groups)
