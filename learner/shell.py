"""The learner's process shell: everything around the maths.

Builds the model, optimizer, data, dispatcher, experience state, weight publisher, server and metrics
endpoints (restoring them from a checkpoint on `--resume`), and gives the loop in train.py named calls:
wait for a batch, publish a new version, record a metrics row, evaluate, checkpoint, finish, close.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from exgrpo_async.config import RunConfig
from exgrpo_async.data import (DataError, QuestionSampler, load_pool, prompt_token_limit, render_prompt,
                               set_chat_template, too_long)
from exgrpo_async.layout import CoreClock, idle_medians
from exgrpo_async.logs import log_format
from exgrpo_async.metrics import check_trackers
from exgrpo_async.rollout import RolloutGroup
from exgrpo_async.weight_sync import WeightPublisher
from learner.checkpoint import (
    latest_valid,
    load_checkpoint,
    pack_ragged,
    read_training_state,
    save_checkpoint,
    unpack_ragged,
)
from learner.dispatch import Dispatcher, WorkItem
from learner.inbox import Inbox, fill_batch, paired_gain, question_books, run_eval, without_per_question
from learner.maths.batch import Batch
from learner.maths.experience import Experience
from learner.maths.update import StepSettings
from learner.metrics import LearnerMetrics, TargetsFile
from learner.model import pick_device, save_policy
from learner.overlap import Accumulator, WholeBatch
from learner.peers import actor_idle_share
from learner.policy import Policy
from learner.ranks import Ranks
from learner.server import LearnerServer
from learner.trackers import Trackers

log = logging.getLogger("exgrpo_async.learner")
STOP_FILE = "STOP"  # `touch RUN_DIR/STOP` ends a run after its current step, finished as at max_steps


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the metrics rows up to `last_step` (a resumed run writes the later ones again)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
        path.write_text("".join(line + "\n" for line in keep))


class Shell:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool, ranks: Ranks):
        self.cfg, self.run_dir = cfg, run_dir
        L = cfg.learner
        check_trackers(cfg.metrics.trackers)  # a missing extra fails before the model is built
        self.ranks = ranks
        self.device = ranks.device if ranks.world > 1 else pick_device(L.device)
        torch.manual_seed(L.seed)
        self.rng = random.Random(L.seed)
        self.policy = Policy(cfg, ranks, self.device)  # fp32 master weights, sharded over the ranks
        self.model, self.tokenizer, self.opt = self.policy.model, self.policy.tokenizer, self.policy.opt
        self.sync_dtype = getattr(torch, cfg.model.dtype)  # what the actors run
        self._load_data()
        B, K = L.questions_per_step, cfg.rollout.samples_per_question
        self.dispatcher = Dispatcher(self.sampler.next, B, K, cfg.rollout.temperature, L.max_staleness,
                                     self.sampler.exclude, sampling_seed=L.seed if cfg.rollout.seeded else None,
                                     include_questions=self.sampler.include,
                                     discard_displaced=cfg.exgrpo.enabled and cfg.exgrpo.discard_displaced)
        self.experience = Experience(cfg.exgrpo, K, B, seed=L.seed)
        self.overlap = L.overlap_arrival and ranks.world == 1 and L.minibatches_per_step == 1
        if L.overlap_arrival and not self.overlap:
            log.info("learner.overlap_arrival: %s, so each step waits for its whole batch before the first forward",
                     "several learner ranks" if ranks.world > 1 else "several mini-batches per step")
        self.totals = {"rollouts": 0, "tokens": 0, "stale_dropped": 0, "skipped_steps": 0, "verify_timeouts": 0,
                       "verify_errors": 0}
        self.version, self.opt_updates, self.first_sync_checked, self.start_step = 0, 0, False, 1
        self._stopped = False
        self.summary: dict = {"before": None, "after": None, "best": None}  # best: step, score, by_source
        self.ckpt_root = run_dir / "checkpoints"
        self.resumed = self._restore() if resume else False
        self._start_server()
        self.metrics_f = open(run_dir / "metrics.jsonl", "a")
        self.trackers = Trackers(cfg.metrics, run_dir, cfg.model_dump(mode="json"), self.start_step, self.resumed)
        self._tokens_at_start, self._rollouts_at_start = self.totals["tokens"], self.totals["rollouts"]
        self._next_eval_tokens = self._after(self.totals["tokens"], L.eval_every_tokens)
        self._empty_buffer_steps = 0
        self._busy: dict = {}  # the actors' busy seconds at the previous step (for actor_idle_frac)
        self._idle: dict[str, list[float]] = {"learner": [], "actor": [], "cores": []}  # per step, for the balance
        self._cores = CoreClock()
        self._last_step_s = 0.0  # the previous step's wall time: the longest wait_for_batch holds groups back
        self.t_start = self._t_progress = self._stall_warned = self._progress_logged = time.time()

    # ------------------------------------------------------------------ set-up
    def _load_data(self) -> None:
        d, tok = self.cfg.data, self.tokenizer
        set_chat_template(tok, d.chat_template)  # the exported models carry it too
        train_pool = load_pool(d.train_files, skip_bad_rows=d.skip_bad_rows)
        self.eval_pool = load_pool([d.eval_file], skip_bad_rows=d.skip_bad_rows) if d.eval_file else None
        if train_pool.skipped:
            log.warning("skipped %d bad training rows (first: %s)", len(train_pool.skipped), train_pool.skipped[0])
        self.rows_skipped = len(train_pool.skipped) + (len(self.eval_pool.skipped) if self.eval_pool else 0)
        render = lambda q: render_prompt(q, d.prompt_template, d.system_prompt, d.use_chat_template, tok)  # noqa: E731
        self.questions = {"train": train_pool.questions, "eval": self.eval_pool.questions if self.eval_pool else []}
        self.prompts = {name: [render(q) for q in qs] for name, qs in self.questions.items()}
        limit, why = prompt_token_limit(d.max_prompt_tokens, self.cfg.model.max_model_len,
                                        self.cfg.rollout.max_new_tokens)
        long = {name: too_long(prompts, tok, limit) for name, prompts in self.prompts.items()}
        self.prompts_too_long = {name: len(ids) for name, ids in long.items()}  # summary.json
        keep = {name: [i for i in range(len(self.questions[name])) if i not in long[name]] for name in long}
        for name, kind, fate in (("train", "training", "skipped"), ("eval", "held-out", "left out")):
            if long[name]:
                log.warning("%d of %d %s questions %s: prompts longer than %d tokens (%s)", len(long[name]),
                            len(self.questions[name]), kind, fate, limit, why)
            if self.questions[name] and not keep[name]:
                raise DataError(f"no {kind} question's prompt fits in {limit} tokens ({why})")
        # the held-out set is the questions that fit, in order (its evaluations index them by position)
        self.questions["eval"] = [self.questions["eval"][i] for i in keep["eval"]]
        self.prompts["eval"] = [self.prompts["eval"][i] for i in keep["eval"]]
        self.sampler = QuestionSampler(keep["train"], seed=d.shuffle_seed)

    def _restore(self) -> bool:
        """Before any actor can connect: the server hands out work from the restored queues."""
        ckpt = latest_valid(self.ckpt_root)
        if ckpt is None:
            log.warning("--resume: no valid checkpoint in %s; starting from the beginning", self.ckpt_root)
            return False
        X = self.cfg.exgrpo
        st = load_checkpoint(ckpt, None, None, self.experience.buffer if X.enabled else None, verify=False)
        self.policy.load_state(*read_training_state(ckpt, self.model))  # into this world size, whatever saved it
        self.dispatcher.load_state_dict(st["dispatcher"], self.sampler)
        self.rng.setstate(st["rng"])
        self.version, self.opt_updates, self.first_sync_checked = st["version"], st["opt_updates"], st["first_sync_checked"]
        self.totals.update(st["totals"])
        self.experience.load_state_dict(st, unpack_ragged(st["prompt_ids_of"]))
        self.start_step, self.summary["before"] = st["step"] + 1, st.get("eval_before")
        self.summary["best"] = st.get("eval_best")
        _truncate_metrics(self.run_dir / "metrics.jsonl", st["step"])  # rows of the lost steps are written again
        log.info("resumed from %s: step %d, policy version %d", ckpt, st["step"], self.version)
        return True

    def _start_server(self) -> None:
        """Version 0 is published first; then the server starts handing out work."""
        cfg, L = self.cfg, self.cfg.learner
        backend = cfg.weight_sync.backend if cfg.weight_sync.backend != "auto" else (
            "nccl" if self.device.type == "cuda" else "gloo")
        sets = cfg.weight_sync.publish_sets or (1 if self.device.type == "cuda" else None)
        self.publisher = WeightPublisher(cfg.transport.host, cfg.weight_sync.port, backend,
                                         self.device if backend == "nccl" else torch.device("cpu"),
                                         cfg.weight_sync.bucket_mb, cfg.weight_sync.timeout_s, max_sets=sets)
        self.policy.publish(self.publisher, self.version, self.sync_dtype)
        self.server = server = LearnerServer(cfg, self.dispatcher, self.publisher, backend, self.prompts,
                                             self.questions, cfg.model_dump_json())
        self.inbox = Inbox(server)
        self.prom = None
        if cfg.metrics.port is not None:
            self.prom = LearnerMetrics(cfg.metrics.host, cfg.metrics.port, L.max_staleness, exgrpo=cfg.exgrpo.enabled,
                                       is_weights=L.off_policy_correction != "none")
            server.on_sync = self.prom.observe_sync
            self.prom.watch_live(connected=lambda: len(server.actors),
                                 inbox=lambda: server.received.qsize() + len(self.inbox.train),
                                 in_flight=lambda: len(self.dispatcher.outstanding))
        server.targets = TargetsFile(self.run_dir, cfg.metrics.sd_dir, self.prom.endpoint.address if self.prom else None)
        server.start()
        tmp = self.run_dir / "learner.json.tmp"  # whole or absent: actors started beside us read it (actors/main.py)
        tmp.write_text(json.dumps({"address": server.address, "metrics_port": self.prom.port if self.prom else None}))
        tmp.replace(self.run_dir / "learner.json")
        log.info("learner listening on %s (weight sync %s on port %d)", server.address, backend, self.publisher.port)
        if self.prom is not None:
            log.info("Prometheus metrics on http://%s/metrics; targets in %s", self.prom.endpoint.address,
                     ", ".join(str(p) for p in server.targets.paths))
            self.prom.mark_progress()

    # ------------------------------------------------------------------ the loop's calls
    def begin_update(self, settings: StepSettings) -> Accumulator | WholeBatch:
        """This step's update, to be fed the groups as they arrive (learner/overlap.py): micro-batches
        computed while the batch fills where that gives the same gradient, else the whole batch at once."""
        L = self.cfg.learner
        if self.overlap:
            return Accumulator(self.policy, settings, self.version, self.experience.mixed, L.questions_per_step)
        return WholeBatch(self.policy, settings, self.version, self.experience.mixed, self.rng)

    def wait_for_batch(self, step: int, take: Callable[[WorkItem, RolloutGroup], None]) -> None:
        """Hand B training groups to `take`, those about to expire first; groups staler than eta are
        dropped and re-issued (learner/inbox.py, `fill_batch`)."""
        L = self.cfg.learner
        dropped = fill_batch(self.inbox, self.dispatcher, self.version, L, self._last_step_s, take,
                             self._warn_if_stalled)
        self.totals["stale_dropped"] += dropped
        if dropped:
            log.warning("step %d: dropped %d groups staler than eta=%d and re-issued them (ExgrpoStalenessAboveEta)",
                        step, dropped, L.max_staleness)

    def _warn_if_stalled(self, ready: int) -> None:
        now, limit = time.time(), self.cfg.metrics.stall_warning_s
        if now - self._t_progress > limit and now - self._stall_warned > limit:
            self._stall_warned = now
            log.warning("no step for %.0f s: %d of %d groups ready, %d actors connected, %d work items out "
                        "(ExgrpoLearnerStalled)", now - self._t_progress, ready, self.cfg.learner.questions_per_step,
                        self.server.connected, len(self.dispatcher.outstanding))

    def count_batch(self, b: Batch) -> None:
        self.totals["rollouts"] += len(b.seqs)
        self.totals["tokens"] += b.fresh_tokens
        self.totals["verify_timeouts"] += b.verify_timeouts
        self.totals["verify_errors"] += b.verify_errors

    def publish_next_version(self, diff_max: float | None) -> float:
        """Bump the policy version, publish its weights, let the dispatcher admit more work."""
        self.version += 1
        t0 = time.time()
        self.policy.publish(self.publisher, self.version, self.sync_dtype)
        seconds = time.time() - t0
        self.dispatcher.trained(self.cfg.learner.questions_per_step, self.version)
        if not self.first_sync_checked and diff_max is not None:  # actors' weights all arrived by broadcast
            log.info("after the first weight sync: max |logp_vllm - logp_learner| = %.3g on version %d",
                     diff_max, self.version - 1)
            self.first_sync_checked = True
        return seconds

    def step_timings(self, t_step: float, t_wait: float, t_train: float, t_pub: float) -> dict:
        s = self.server
        syncs, stalls, pauses = s.sync_seconds.take(), s.update_stalls.take(), s.update_pauses.take()
        busy_before, self._busy = self._busy, dict(s.actor_busy)  # a copy: the server thread writes it
        now = time.time()
        self._last_step_s = now - t_step
        learner_idle, actor_idle = t_wait / max(1e-9, now - t_step), actor_idle_share(busy_before, self._busy)
        cores_busy = self._cores.busy_since_last()
        if actor_idle is not None:
            self._idle["learner"].append(learner_idle)
            self._idle["actor"].append(actor_idle)
            if cores_busy is not None:
                self._idle["cores"].append(cores_busy)
        return {"sync_seconds": sum(syncs) / len(syncs) if syncs else 0.0, "publish_seconds": t_pub,
                "step_seconds": now - t_step, "wait_seconds": t_wait, "train_seconds": t_train,
                "learner_idle_frac": learner_idle, "actor_idle_frac": actor_idle, "cores_busy_frac": cores_busy,
                "update_pause_seconds": sum(pauses) / len(pauses) if pauses else None,
                "update_stall_seconds": sum(stalls) / len(stalls) if stalls else None,
                "update_stall_max_seconds": max(stalls, default=None)}

    def run_counters(self) -> dict:
        t, s, elapsed = self.totals, self.server, max(1e-9, time.time() - self.t_start)
        return {"tokens_generated_total": t["tokens"], "stale_dropped_total": t["stale_dropped"],
                "skipped_steps_total": t["skipped_steps"], "optimizer_updates_total": self.opt_updates,
                "actors": s.connected, "rollouts_per_s": (t["rollouts"] - self._rollouts_at_start) / elapsed,
                "tokens_per_s": (t["tokens"] - self._tokens_at_start) / elapsed,
                "bad_messages_total": s.counters["bad_messages"], "verify_timeouts_total": t["verify_timeouts"],
                "verify_errors_total": t["verify_errors"]}

    def record(self, row: dict, bar) -> None:
        """Write the row (metrics.jsonl, Prometheus), warn on an empty buffer, move the progress bar."""
        self.metrics_f.write(json.dumps(row) + "\n")
        self.metrics_f.flush()
        self.trackers.log_step(row)
        if self.prom is not None:
            self.prom.observe_step(row, dict(self.server.counters))  # it exports those it has a counter for
        self._t_progress = time.time()
        ex = self.experience
        if ex.mixed and ex.buffer.num_trajectories == 0:
            self._empty_buffer_steps += 1
            if self._empty_buffer_steps % self.cfg.metrics.buffer_empty_warning_steps == 0:
                log.warning("experience buffer empty for %d steps after the delayed start: no partly solved "
                            "question has been collected (ExgrpoBufferEmpty)", self._empty_buffer_steps)
        else:
            self._empty_buffer_steps = 0
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", stale=f"{row['staleness_mean']:.2f}",
                        tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
        bar.update(1)
        L = self.cfg.learner
        if log_format() == "json" and (time.time() - self._progress_logged > 30 or row["step"] == L.max_steps):
            self._progress_logged = time.time()
            log.info("step %d/%d: reward %.3f, staleness %.2f, %.0f tokens/s", row["step"], L.max_steps,
                     row["reward_mean"], row["staleness_mean"], row["tokens_per_s"])

    def progress_bar(self):
        """A terminal gets a live bar; a log file (CI, nohup) one line every 30 s; JSON logs none (a
        progress record every 30 s instead: a bar is not a JSON line)."""
        from tqdm import tqdm

        return tqdm(total=self.cfg.learner.max_steps, initial=self.start_step - 1, desc="RL", unit="step",
                    dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 30.0,
                    disable=log_format() == "json")

    # ------------------------------------------------------------------ evaluation
    def evaluate_before(self) -> None:
        if self.eval_pool and not self.resumed and self.cfg.learner.eval_before:
            self.summary["before"] = self._eval(self.version)
            self.trackers.log_eval(0, self.summary["before"])
            log.info("held-out before: %s", without_per_question(self.summary["before"]))
        self.t_start = time.time()

    @staticmethod
    def _after(tokens: int, every: int) -> int | None:
        return (tokens // every + 1) * every if every else None

    def budget_spent(self, step: int) -> bool:
        """Whether a token or time budget (`max_generated_tokens`, `max_seconds`) or a stop file
        (RUN_DIR/STOP, which this consumes) ends the run at `step`."""
        L = self.cfg.learner
        stop = self.run_dir / STOP_FILE
        if stop.exists():
            stop.unlink()  # read once: a resumed run does not stop at its first step
            log.info("step %d: %s found; ending the run as at learner.max_steps", step, stop)
            return True
        if L.max_generated_tokens is not None and self.totals["tokens"] >= L.max_generated_tokens:
            log.info("step %d: %d fresh tokens generated, budget %d reached", step, self.totals["tokens"],
                     L.max_generated_tokens)
            return True
        if L.max_seconds is not None and time.time() - self.t_start >= L.max_seconds:
            log.info("step %d: %.0f s of training, budget %.0f s reached", step, time.time() - self.t_start,
                     L.max_seconds)
            return True
        return False

    def evaluation_due(self, step: int) -> bool:
        L = self.cfg.learner
        if not self.eval_pool or step >= L.max_steps:
            return False
        by_tokens = self._next_eval_tokens is not None and self.totals["tokens"] >= self._next_eval_tokens
        if L.max_generated_tokens is not None and self.totals["tokens"] >= L.max_generated_tokens:
            return False  # the run ends now and evaluates its final weights anyway
        return bool(L.eval_every and step % L.eval_every == 0) or by_tokens

    def evaluate_during(self, step: int) -> None:
        ev = self._eval(self.version)
        self._next_eval_tokens = self._after(self.totals["tokens"], self.cfg.learner.eval_every_tokens)
        self.metrics_f.write(json.dumps({"step": step, "policy_version": self.version,
                                         "tokens_generated_total": self.totals["tokens"],
                                         "eval": without_per_question(ev)}) + "\n")
        self.metrics_f.flush()
        self.trackers.log_eval(step, ev)
        self.keep_if_best(step, ev)

    def keep_if_best(self, step: int, ev: dict) -> None:
        """Export the weights to RUN_DIR/best when this evaluation's score (the mean over the sources
        other than `learner.best_exclude_sources`) beats every earlier one of the run."""
        best = self.summary["best"]
        if ev["score"] is None or (best is not None and ev["score"] <= best["score"]):
            return
        out = self.run_dir / "best"
        save_policy(self.model, self.tokenizer, out, self.cfg.model.dtype,
                    weights=self.policy.full_state(optimizer=False)[0])
        self.summary["best"] = {"step": step, "policy_version": self.version, "score": ev["score"],
                                "by_source": ev["by_source"], "excluded": self.cfg.learner.best_exclude_sources,
                                "path": str(out)}
        (out / "best.json").write_text(json.dumps(self.summary["best"], indent=2))
        log.info("best weights so far (step %d, score %.4f): %s", step, ev["score"], out)

    def _eval(self, version: int) -> dict:
        return run_eval(self.inbox, self.dispatcher, [q.source for q in self.questions["eval"]], self.cfg, version)

    # ------------------------------------------------------------------ checkpoints and the end
    def checkpoint(self, step: int) -> None:
        self.inbox.drain()  # groups already received wait in the inbox; the checkpoint re-queues them
        ex = self.experience
        state = {"version": self.version, "opt_updates": self.opt_updates, "totals": self.totals,
                 "rng": self.rng.getstate(), "first_sync_checked": self.first_sync_checked,
                 **ex.state_dict(), "prompt_ids_of": pack_ragged(ex.prompt_ids_of),
                 "dispatcher": self.dispatcher.state_dict([it for it, _ in self.inbox.train], self.sampler),
                 "eval_before": self.summary["before"], "eval_best": self.summary["best"]}
        t0 = time.time()
        path = save_checkpoint(self.ckpt_root, step, self.model, self.tokenizer, self.opt, state,
                               ex.buffer if self.cfg.exgrpo.enabled else None, self.cfg.learner.keep_checkpoints,
                               full_state=self.policy.full_state())
        log.info("checkpoint %s (%.1fs)", path, time.time() - t0)

    def finish(self, last_step: int) -> dict:
        """Evaluate the final weights, save the model, close the books, write summary.json."""
        rl_seconds = time.time() - self.t_start
        if self.eval_pool:
            self.summary["after"] = self._eval(self.version)
            self.trackers.log_eval(last_step, self.summary["after"])
            self.keep_if_best(last_step, self.summary["after"])
        save_policy(self.model, self.tokenizer, self.run_dir / "final", self.cfg.model.dtype,
                    weights=self.policy.full_state(optimizer=False)[0])
        self.policy.stop()  # the other learner ranks are done
        self._stopped = True
        s, t = self.server, self.totals
        s.stop()  # no more dispatch: the books below are final
        self.summary.update(question_books(self.dispatcher, self.inbox, s))
        if self.summary["questions_unaccounted"]:
            log.error("%d training questions were dispatched but neither trained, re-issued nor in flight",
                      self.summary["questions_unaccounted"])
        self.summary.update({
            "steps": last_step, "rl_seconds": rl_seconds, "rollouts": t["rollouts"], "tokens_generated": t["tokens"],
            "rollouts_per_s": (t["rollouts"] - self._rollouts_at_start) / rl_seconds,
            "tokens_per_s": (t["tokens"] - self._tokens_at_start) / rl_seconds,
            "sync_seconds_mean": s.sync_seconds.mean() or 0.0,
            "syncs": s.sync_seconds.count, "stale_dropped": t["stale_dropped"],
            "update_stall_seconds_mean": s.update_stalls.mean(),
            "actors_lost": s.counters["actors_lost"], "work_reissued": s.counters["work_reissued"],
            "work_released": s.counters["work_released"], "rejoin_requests": s.counters["rejoin_requests"],
            "unknown_work": s.counters["unknown_work"], "actors_joined": s.joined,
            "joins_refused": s.counters["joins_refused"],
            **{k: s.counters[k] for k in ("fingerprints_checked", "fingerprints_unchecked",
                                          "weight_fingerprint_mismatches", "fingerprint_rejected_groups")},
            "skipped_steps": t["skipped_steps"], "bad_messages": s.counters["bad_messages"],
            "data_rows_skipped": self.rows_skipped,  # bad rows of the train and eval files (data.skip_bad_rows)
            "prompts_too_long": self.prompts_too_long,  # questions left out, by pool: their prompts do not fit
            "held_out_curve": held_out_curve(self.run_dir / "metrics.jsonl", self.summary, last_step),
            "gain": paired_gain(self.summary["before"], self.summary["after"])
            if self.summary["before"] and self.summary["after"] else None,
            **idle_medians(self._idle),
            "final_model": str(self.run_dir / "final"),
        })
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        self.trackers.log_summary(self.summary)
        return self.summary

    def close(self, crashed: bool) -> None:
        if not crashed and not self._stopped:  # interrupted between steps: release the other ranks
            self.policy.stop()
        self.metrics_f.close()
        self.trackers.close(crashed)
        self.server.stop()
        if not crashed:  # a crashed learner leaves its targets listed: down targets are what alerts see
            self.server.targets.close()
        if self.prom is not None:
            self.prom.close()



def held_out_curve(metrics: Path, summary: dict, last_step: int) -> list[dict]:
    """summary.json's held_out_curve, from metrics.jsonl's eval rows and the evaluations before and after."""
    from exgrpo_async.report.write import held_out_curve as curve  # matplotlib's import, at the end only
    from exgrpo_async.report.write import read_metrics

    return curve(read_metrics(metrics)[1], summary, last_step)
