"""The learner loop, top to bottom: wait for a batch (with `learner.overlap_arrival`, updating on its
groups as they arrive) -> finish the update -> ExGRPO bookkeeping -> publish -> metrics row.

On-policy GRPO (Dr.GRPO variant) with asynchronous actors, and ExGRPO experience replay when enabled:
- actors pull work from the dispatcher and stream back groups of K completions; the dispatcher's
  admission cap keeps at most `max_staleness` versions of work in flight, and groups that still arrive
  too stale are dropped and re-issued (an experience group with its replayed trajectory), counted;
- the update (learner/maths/update.py) is decoupled PPO against pi_prox with truncated importance weights for
  stale or numerically different behaviour log-probs, every loss term on one `LossScale`;
- ExGRPO's step-end rules (learner/maths/experience.py) retire, collect, switch and choose the next replays;
- each step bumps the policy version and publishes the weights; actors fetch them before their next
  batch. Held-out accuracy is measured by the actors themselves (eval work items).
The process shell (model, server, publisher, checkpoints, evaluation) lives in learner/shell.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from exgrpo_async.config import RunConfig
from exgrpo_async.report.write import write_report
from learner.maths.update import StepSettings
from learner.ranks import Ranks
from learner.shell import Shell
from learner.step_metrics import batch_stats, loss_stats, phase_seconds

log = logging.getLogger("exgrpo_async.learner")


def run(cfg: RunConfig, run_dir: Path, ranks: Ranks, resume: bool = False) -> dict:
    """Train (rank 0 of the learner's ranks); with `resume`, continue from the newest valid checkpoint in
    run_dir/checkpoints."""
    sh = Shell(cfg, run_dir, resume, ranks)
    L = cfg.learner
    crashed = False
    try:
        sh.evaluate_before()
        bar = sh.progress_bar()
        step = sh.start_step - 1
        for step in range(sh.start_step, L.max_steps + 1):
            t_step = time.time()
            settings = StepSettings(clip=_clip(cfg, sh.experience.started), nan_drill=step in L.fault_nan_loss_at_steps)
            upd = sh.begin_update(settings)  # learner/overlap.py: whole batch, or micro-batches as groups arrive
            sh.wait_for_batch(step, upd.add)  # B groups, too-stale ones dropped and re-issued
            t_wait = time.time() - t_step - upd.busy  # idle: waiting with nothing to compute

            t_train = time.time()
            batch, res = upd.finish(sh.opt_updates)  # on every learner rank
            sh.count_batch(batch)
            sh.opt_updates += res.updates
            sh.totals["skipped_steps"] += res.skipped
            t_train = time.time() - t_train + upd.busy

            t_ex = time.time()
            ex = sh.experience.end_step(step, batch, res.pi_past, sh.version, sh.dispatcher, sh.policy.score, sh.rng)
            t_ex = time.time() - t_ex
            t_pub = sh.publish_next_version(res.diff_max)

            row = {"step": step, "policy_version": sh.version, **batch_stats(batch), **loss_stats(res),
                   **sh.step_timings(t_step, t_wait, t_train, t_pub), **phase_seconds(res, t_ex),
                   **sh.run_counters(), **ex}
            sh.record(row, bar)
            if sh.evaluation_due(step):
                sh.evaluate_during(step)
            if L.checkpoint_every and step % L.checkpoint_every == 0 and step < L.max_steps:
                sh.checkpoint(step)
            if sh.budget_spent(step):
                break
        bar.close()
        if step >= sh.start_step:  # the final state, for `--resume` with a larger max_steps
            sh.checkpoint(step)
        summary = sh.finish(step)
        try:  # the model and the figures are saved: a plotting failure must not fail the run
            log.info("report: %s", write_report(run_dir))
        except Exception:
            log.exception("could not write the run report (`exgrpo-async report %s` retries)", run_dir)
        return summary
    except BaseException as e:
        crashed = not isinstance(e, (SystemExit, KeyboardInterrupt))  # a stop by signal is not a crash
        raise
    finally:
        sh.close(crashed)


def _clip(cfg: RunConfig, started: bool) -> float | None:
    """The PPO clip of this step: `clip_eps`, unless the schedule removes it once the switch has fired."""
    L = cfg.learner
    if L.clip_eps <= 0 or (L.clip_schedule == "until_start" and started):
        return None
    return L.clip_eps
