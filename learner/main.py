"""Entry point of a learner rank: join the learner's ranks, resolve the config, then lead or follow.

Rank 0 (the only rank at `learner.world_size=1`) makes the run folder and runs the loop (train.py);
the other ranks load the same policy and follow rank 0's operations (learner/policy.py). Started by
`exgrpo-async train`, or by `torchrun --nproc-per-node N -m exgrpo_async.launcher.cli learner ...` (any nodes).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from exgrpo_async import precision
from exgrpo_async.config import RunConfig
from exgrpo_async.data import DataError
from exgrpo_async.layout import standalone_threads
from exgrpo_async.runs import new_run_dir, resolve_toy
from exgrpo_async.startup import without_gc

log = logging.getLogger("exgrpo_async.learner")


def main(cfg: RunConfig, run_dir: str | None, resume: bool = False) -> NoReturn:
    from learner.ranks import Ranks, end_rank_process

    L = cfg.learner
    torch.set_num_threads(standalone_threads(cfg))
    ranks = Ranks.from_env(L.world_size, L.device, L.rank_timeout_s)
    if ranks.world == 1:  # a failure propagates (its traceback, exit 1); a finished run skips finalization
        end_rank_process(_run_rank(_resolve_precision(cfg, ranks), run_dir, resume, ranks))
    if ranks.lead:  # SIGTERM stops the lead between two operations, never inside one (Ranks.together)
        signal.signal(signal.SIGTERM, lambda *_: ranks.request_stop())
    else:
        signal.signal(signal.SIGTERM, lambda *_: _follower_sigterm(ranks.rank))
    _end_together(ranks, _run_guarded(cfg, run_dir, resume, ranks))


def _follower_sigterm(rank: int) -> None:
    """A follower does not stop on its own: the lead stops every rank together ("stop", then the final
    barrier), and a lead that is gone ends the follower's wait. A follower that left on SIGTERM while the
    lead (SIGTERMed too, by `train`, Slurm or torchrun) still had to announce its stop would break that
    broadcast: the lead's "Connection closed by peer" (ops/bench/system/rank_exit_stress.py)."""
    log.warning("learner rank %d: SIGTERM; it ends when the lead stops the run", rank)


def _run_guarded(cfg: RunConfig, run_dir: str | None, resume: bool, ranks) -> int:
    """A rank of several: its whole life, every way it can end turned into an exit code (0 done, 143
    SIGTERM, 1 an exception, logged with its traceback)."""
    try:
        return _run_rank(_resolve_precision(cfg, ranks), run_dir, resume, ranks)
    except SystemExit as e:  # the SIGTERM handler (exgrpo_async/launcher/cli.py) or an explicit exit
        code = e.code if isinstance(e.code, int) else 1
        log.warning("learner rank %d stopped (exit %d)", ranks.rank, code)
        return code
    except BaseException:  # noqa: BLE001: any failure ends this rank with its traceback logged
        log.exception("learner rank %d failed", ranks.rank)
        return 1


def _end_together(ranks, rc: int) -> NoReturn:
    """The one way a rank of several ends. After a clean run every rank meets in a final barrier, which
    the lead enters only once it has finished everything (summary, report, closing; the followers wait
    for that outside the collective, `Ranks.meet_at_end`): no rank tears its
    transport down while another may still be in a collective, and a follower never exits while the
    lead is alive. Then the process ends without the interpreter's finalization (`end_rank_process`: a
    gloo worker thread can abort it); `os._exit` closes the group's sockets. A failed rank skips the
    barrier: the launcher stops the others. A lead stopped by SIGTERM (143) has announced its stop
    like a finished one and meets the followers the same way."""
    from learner.ranks import end_rank_process

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ending already: a late SIGTERM must not skip os._exit
    if rc in (0, 143):
        try:
            ranks.meet_at_end()
        except Exception:  # noqa: BLE001: a peer gone at the very end: this rank's run still failed
            log.exception("learner rank %d: the final barrier failed", ranks.rank)
            rc = 1
    end_rank_process(rc)


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
    with without_gc():  # transformers' import, the policy's among the learner's (exgrpo_async/startup.py)
        from learner.train import run

    try:
        run(cfg, out, ranks, resume=resume)
    except DataError as e:  # the user's data (no question fits, no chat template): one line, not a traceback
        log.error("learner: %s", e)
        return 2
    return 0


def _follow(cfg: RunConfig, ranks) -> int:
    with without_gc():  # exgrpo_async/startup.py
        from learner.policy import Policy

    torch.manual_seed(cfg.learner.seed)
    Policy(cfg, ranks, ranks.device).follow()
    return 0
