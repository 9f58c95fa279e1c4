"""Entry point of a learner rank: join the learner's ranks, resolve the config, then lead or follow.

Rank 0 (the only rank at `learner.world_size=1`) makes the run folder and runs the loop (train.py);
the other ranks load the same policy and follow rank 0's operations (learner/policy.py). Started by
`exgrpo-async train`, or by `torchrun --nproc-per-node N -m exgrpo_async.cli learner ...` (any nodes).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from exgrpo_async import precision
from exgrpo_async.config import RunConfig
from exgrpo_async.launch import new_run_dir, resolve_toy
from exgrpo_async.layout import standalone_threads


def main(cfg: RunConfig, run_dir: str | None, resume: bool = False) -> int:
    from learner.ranks import Ranks, end_rank_process

    L = cfg.learner
    torch.set_num_threads(standalone_threads(cfg))
    ranks = Ranks.from_env(L.world_size, L.device, L.rank_timeout_s)
    try:
        cfg = _resolve_precision(cfg, ranks)
        rc = _run_rank(cfg, run_dir, resume, ranks)
    finally:
        ranks.close()
    if ranks.world > 1:
        end_rank_process(rc)  # a clean exit that a gloo worker thread cannot abort
    return rc


def _resolve_precision(cfg: RunConfig, ranks) -> RunConfig:
    """"auto" precision (a standalone learner; `train` resolves it at launch): rank 0 decides from this
    machine, the other ranks take its decision, so every rank computes in the same dtype."""
    if not precision.needs_resolving(cfg):
        return cfg
    from learner.model import pick_device

    gpus = int(pick_device(cfg.learner.device).type == "cuda")
    bf16 = torch.tensor([int(ranks.lead and precision.bf16_is_fast(gpus))], device=ranks.device)
    if ranks.world > 1:
        dist.broadcast(bf16, src=0)
    return precision.apply(cfg, bool(bf16.item()))


def _run_rank(cfg: RunConfig, run_dir: str | None, resume: bool, ranks) -> int:
    """Rank 0's run, or a follower's life (every rank but 0)."""
    if ranks.lead:
        cfg = resolve_toy(cfg)  # builds the toy policy once, before the other ranks read it
    if ranks.world > 1:
        dist.barrier()
    if not ranks.lead:
        return _follow(resolve_toy(cfg), ranks)
    out = Path(run_dir) if run_dir else new_run_dir(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    from learner.train import run

    run(cfg, out, ranks, resume=resume)
    return 0


def _follow(cfg: RunConfig, ranks) -> int:
    from learner.policy import Policy

    torch.manual_seed(cfg.learner.seed)
    Policy(cfg, ranks, ranks.device).follow()
    return 0
