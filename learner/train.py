"""The learner loop, top to bottom: receive rollouts -> form groups -> advantages -> loss -> step -> publish.

On-policy GRPO (Dr.GRPO variant) with asynchronous actors:
- actors pull work from the dispatcher and stream back groups of K completions; the dispatcher's
  admission cap keeps at most `max_staleness` versions of work in flight, and groups that still arrive
  too stale are dropped and their questions re-issued (counted, never lost);
- staleness-aware correction (decoupled PPO, `learner.off_policy_correction`): the PPO ratio is taken
  against pi_prox, the learner's own log-probs before the step's update, and each token is weighted by
  the truncated importance weight min(pi_prox/pi_behav, C) for having been sampled by an older (or
  numerically different) policy in vLLM;
- after each learner step the policy version goes up by one and the new weights are published; actors
  fetch them before their next batch.
Held-out accuracy is measured by the actors themselves (eval work items) before and after training.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exgrpo_async.config import RunConfig
from exgrpo_async.data import QuestionSampler, load_pool, render_prompt
from exgrpo_async.logs import log_format
from exgrpo_async.report import write_report
from exgrpo_async.rollout import RolloutGroup
from exgrpo_async.weight_sync import WeightPublisher
from learner.buffer import ExperienceBuffer, Trajectory
from learner.checkpoint import latest_valid, load_checkpoint, pack_ragged, save_checkpoint, unpack_ragged
from learner.dispatch import Dispatcher, WorkItem
from learner.grpo import (group_advantages, mismatch_kl, pack_sequences, policy_loss, scatter_completion,
                          token_logprobs)
from learner.metrics import LearnerMetrics, TargetsFile
from learner.model import load_policy, named_parameters_for_sync, pick_device, save_policy
from learner.replay import select_replays
from learner.server import LearnerServer, actor_idle_share

log = logging.getLogger("exgrpo_async.learner")


@dataclass
class Seq:
    """One completion as the update sees it."""

    prompt: list[int]
    completion: list[int]
    logprobs: torch.Tensor  # behaviour log-probs (fresh) or pi_past (replayed), per completion token
    advantage: float
    staleness: int  # learner version minus the version that generated it
    group: int  # index of its group in the batch
    replay: bool  # an ExGRPO replayed trajectory (off-policy tokens)
    collect: bool  # goes into the experience buffer after this step


@torch.no_grad()
def recompute_logps(model, seqs: list[Seq], keys: list[int], pad_id: int, device, batch: int, temperature: float) -> dict:
    """Per-completion log-probs under the model as it is now (before the step's first update)."""
    out = {}
    for j in range(0, len(seqs), batch):
        chunk = seqs[j:j + batch]
        packed = pack_sequences([s.prompt for s in chunk], [s.completion for s in chunk], pad_id)
        logp = token_logprobs(model, packed["input_ids"].to(device), packed["attention_mask"].to(device), temperature)
        for r, key in enumerate(keys[j:j + batch]):
            out[key] = logp[r][packed["target_mask"][r].to(device)].float().cpu()
    return out


def question_books(dispatcher: Dispatcher, inbox: Inbox, server: LearnerServer) -> dict:
    """Conservation of training questions: each one handed out is trained on, re-issued (which takes it
    off `train_dispatched`), still outstanding, or received and waiting. Anything else was lost."""
    waiting = len(inbox.train) + sum(1 for it, _ in list(server.inbox.queue) if it.purpose == "train")
    outstanding = sum(1 for w in list(dispatcher.outstanding.values()) if w.purpose == "train")
    return {"questions_dispatched": dispatcher.train_dispatched, "questions_trained": dispatcher.train_consumed,
            "questions_in_flight_at_end": outstanding + waiting,
            "questions_unaccounted": dispatcher.train_dispatched - dispatcher.train_consumed - outstanding - waiting}


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the metrics rows up to `last_step` (a resumed run writes the later ones again)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
        path.write_text("".join(line + "\n" for line in keep))


def is_stats(stats: list[dict]) -> dict:
    """Step-level importance-weight statistics from the per-micro-batch ones (token-weighted means)."""
    rows = [s for s in stats if "is_weight_mean" in s]
    if not rows:
        return {"is_weight_mean": None, "is_weight_max": None, "is_truncated_frac": None}
    n = sum(s["tokens"] for s in rows) or 1.0
    return {"is_weight_mean": sum(s["is_weight_mean"] * s["tokens"] for s in rows) / n,
            "is_weight_max": max(s["is_weight_max"] for s in rows),
            "is_truncated_frac": sum(s["is_truncated_frac"] * s["tokens"] for s in rows) / n}


class Inbox:
    """Sorts what the server receives: training groups wait in `train`, eval groups are tallied."""

    def __init__(self, server: LearnerServer):
        self.server = server
        self.train: list[tuple[WorkItem, RolloutGroup]] = []
        self.eval: list[tuple[WorkItem, RolloutGroup]] = []
        self._last_warn = time.monotonic()

    def pump(self, timeout: float) -> None:
        try:
            item, group = self.server.inbox.get(timeout=timeout)
        except queue.Empty:
            if self.server.connected == 0 and time.monotonic() - self._last_warn > 30:
                log.warning("waiting for rollouts, but no actor is connected")
                self._last_warn = time.monotonic()
            return
        self.add(item, group)

    def add(self, item: WorkItem, group: RolloutGroup) -> None:
        (self.eval if item.purpose == "eval" else self.train).append((item, group))


def run_eval(inbox: Inbox, dispatcher: Dispatcher, n_questions: int, cfg: RunConfig, version: int) -> dict:
    """Score the held-out set with the weights of `version`: avg@n sampled and greedy accuracy."""
    qids = list(range(n_questions))
    inbox.eval.clear()
    dispatcher.add_eval(qids, cfg.rollout.eval_samples, cfg.rollout.eval_temperature, version)
    dispatcher.add_eval(qids, 1, 0.0, version)
    t0 = time.time()
    while len(inbox.eval) < 2 * n_questions:
        inbox.pump(0.5)
    sampled = [r for it, g in inbox.eval if it.temperature > 0 for r in g.rewards]
    greedy = [r for it, g in inbox.eval if it.temperature == 0 for r in g.rewards]
    versions = {g.policy_version for _, g in inbox.eval}
    inbox.eval.clear()
    return {"accuracy": sum(sampled) / len(sampled), "greedy_accuracy": sum(greedy) / len(greedy),
            "versions": sorted(versions), "seconds": time.time() - t0}


def run(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict:
    """Train; with `resume`, continue from the newest valid checkpoint in run_dir/checkpoints."""
    # --- setup: device, model, data, optimizer -----------------------------------------------
    device = pick_device(cfg.learner.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.learner.seed)
    rng = random.Random(cfg.learner.seed)
    backend = cfg.weight_sync.backend if cfg.weight_sync.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    d = cfg.data
    train_pool = load_pool(d.train_files, skip_bad_rows=d.skip_bad_rows)
    eval_pool = load_pool([d.eval_file], skip_bad_rows=d.skip_bad_rows) if d.eval_file else None
    if train_pool.skipped:
        log.warning("skipped %d bad training rows (first: %s)", len(train_pool.skipped), train_pool.skipped[0])
    render = lambda q: render_prompt(q, d.prompt_template, d.system_prompt, d.use_chat_template, tokenizer)  # noqa: E731
    prompts = {"train": [render(q) for q in train_pool.questions]}
    too_long = {i for i, p in enumerate(prompts["train"]) if len(tokenizer(p)["input_ids"]) > d.max_prompt_tokens}
    if too_long:
        log.warning("skipping %d training questions longer than %d prompt tokens", len(too_long), d.max_prompt_tokens)
    keep = [i for i in range(len(train_pool.questions)) if i not in too_long]
    if not keep:
        raise ValueError("no training question fits data.max_prompt_tokens")
    questions = {"train": train_pool.questions, "eval": eval_pool.questions if eval_pool else []}
    prompts["eval"] = [render(q) for q in questions["eval"]]
    sampler = QuestionSampler(keep, seed=d.shuffle_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, betas=cfg.learner.betas,
                            weight_decay=cfg.learner.weight_decay)
    L = cfg.learner
    K, B, L_max = cfg.rollout.samples_per_question, L.questions_per_step, cfg.rollout.max_new_tokens

    # --- process shell: dispatcher, weight publisher, server; version 0 is published first ---------
    dispatcher = Dispatcher(sampler.next, B, K, cfg.rollout.temperature, L.max_staleness, sampler.exclude,
                            sampling_seed=L.seed if cfg.rollout.seeded else None)
    X = cfg.exgrpo  # experience replay (ExGRPO); everything below guarded by X.enabled
    buffer = ExperienceBuffer(K, X.max_trajectories, seed=L.seed)
    prompt_ids_of: dict[int, list[int]] = {}  # question id -> prompt token ids, for replay scoring
    bucket_at_selection: dict[int, int] = {}
    mixed = X.enabled and not X.delayed_start  # the delayed-start switch (one-way)
    totals = {"rollouts": 0, "tokens": 0, "stale_dropped": 0, "skipped_steps": 0, "verify_timeouts": 0,
              "verify_errors": 0}
    version, opt_updates, first_sync_checked, start_step, eval_before = 0, 0, False, 1, None
    ckpt_root = run_dir / "checkpoints"
    ckpt = latest_valid(ckpt_root) if resume else None
    if resume and ckpt is None:
        log.warning("--resume: no valid checkpoint in %s; starting from the beginning", ckpt_root)
    if ckpt is not None:  # before any actor can connect: the server hands out work from the restored queues
        st = load_checkpoint(ckpt, model, opt, buffer if X.enabled else None, verify=False)
        dispatcher.load_state_dict(st["dispatcher"], sampler)
        rng.setstate(st["rng"])
        version, opt_updates, mixed, first_sync_checked = st["version"], st["opt_updates"], st["mixed"], st["first_sync_checked"]
        totals.update(st["totals"])
        bucket_at_selection.update(st["bucket_at_selection"])
        prompt_ids_of.update(unpack_ragged(st["prompt_ids_of"]))
        start_step, eval_before = st["step"] + 1, st.get("eval_before")
        _truncate_metrics(run_dir / "metrics.jsonl", st["step"])  # rows of the lost steps are written again
        log.info("resumed from %s: step %d, policy version %d", ckpt, st["step"], version)

    def checkpoint(step: int) -> None:
        while True:  # groups already received wait in the loop's inbox; the checkpoint re-queues them
            try:
                item, group = server.inbox.get_nowait()
            except queue.Empty:
                break
            inbox.add(item, group)
        state = {"version": version, "opt_updates": opt_updates, "mixed": mixed, "totals": totals,
                 "rng": rng.getstate(), "first_sync_checked": first_sync_checked,
                 "bucket_at_selection": bucket_at_selection, "prompt_ids_of": pack_ragged(prompt_ids_of),
                 "dispatcher": dispatcher.state_dict([it for it, _ in inbox.train], sampler),
                 "eval_before": summary["before"]}
        t0 = time.time()
        path = save_checkpoint(ckpt_root, step, model, tokenizer, opt, state, buffer if X.enabled else None,
                               L.keep_checkpoints)
        log.info("checkpoint %s (%.1fs)", path, time.time() - t0)

    publisher = WeightPublisher(cfg.transport.host, cfg.weight_sync.port, backend,
                                device if backend == "nccl" else torch.device("cpu"),
                                cfg.weight_sync.bucket_mb, cfg.weight_sync.timeout_s)
    publisher.publish(version, named_parameters_for_sync(model))
    server = LearnerServer(cfg, dispatcher, publisher, backend, prompts, questions, cfg.model_dump_json())
    inbox = Inbox(server)
    prom = None
    if cfg.metrics.port is not None:
        prom = LearnerMetrics(cfg.metrics.host, cfg.metrics.port, L.max_staleness, exgrpo=X.enabled,
                              is_weights=L.off_policy_correction != "none")
        server.on_sync = prom.observe_sync
        prom.watch_live(connected=lambda: len(server.actors), inbox=lambda: server.inbox.qsize() + len(inbox.train),
                        in_flight=lambda: len(dispatcher.outstanding))
    server.targets = TargetsFile(run_dir, cfg.metrics.sd_dir, prom.endpoint.address if prom else None)
    server.start()
    (run_dir / "learner.json").write_text(json.dumps({"address": server.address,
                                                       "metrics_port": prom.port if prom else None}))
    log.info("learner listening on %s (weight sync %s on port %d)", server.address, backend, publisher.port)
    if prom is not None:
        log.info("Prometheus metrics on http://%s/metrics; targets in %s", prom.endpoint.address,
                 ", ".join(str(p) for p in server.targets.paths))
    metrics_f = open(run_dir / "metrics.jsonl", "a")
    summary: dict = {"before": eval_before, "after": None}
    crashed = False
    try:
        if eval_pool and ckpt is None:
            summary["before"] = run_eval(inbox, dispatcher, len(questions["eval"]), cfg, version=0)
            log.info("held-out before: %s", summary["before"])

        # --- the RL loop ---------------------------------------------------------------------------
        from tqdm import tqdm

        # a terminal gets a live bar; a log file (CI, nohup) one line every 30 s instead of a flood; JSON
        # logs get a progress log record every 30 s instead (a bar is not a JSON line)
        json_logs = log_format() == "json"
        bar = tqdm(total=L.max_steps, initial=start_step - 1, desc="RL", unit="step", dynamic_ncols=True,
                   mininterval=0.1 if sys.stderr.isatty() else 30.0, disable=json_logs)
        progress_logged = time.time()
        t_start = time.time()
        rollouts_at_start, tokens_at_start = totals["rollouts"], totals["tokens"]
        n_syncs_seen = n_updates_seen = 0
        busy_seen: dict = {}  # the actors' busy seconds at the previous step (for actor_idle_frac)
        empty_buffer_steps = 0  # consecutive steps with experience mixing on and nothing stored
        if prom is not None:
            prom.mark_progress()
        t_progress = stall_warned = time.time()
        step = start_step - 1
        for step in range(start_step, L.max_steps + 1):
            t_step = time.time()
            # 1) wait for B training groups, dropping those too stale to train on
            batch: list[tuple[WorkItem, RolloutGroup]] = []
            dropped = 0
            while len(batch) < B:
                if not inbox.train:
                    inbox.pump(0.5)
                    now = time.time()
                    if now - t_progress > cfg.metrics.stall_warning_s and now - stall_warned > cfg.metrics.stall_warning_s:
                        stall_warned = now
                        log.warning("no step for %.0f s: %d of %d groups ready, %d actors connected, %d work items "
                                    "out (ExgrpoLearnerStalled)", now - t_progress, len(batch), B, server.connected,
                                    len(dispatcher.outstanding))
                    continue
                item, group = inbox.train.pop(0)
                if version - group.policy_version > L.max_staleness:
                    totals["stale_dropped"] += 1
                    dropped += 1
                    dispatcher.reissue(item.question_id)
                    continue
                batch.append((item, group))
            if dropped:
                log.warning("step %d: dropped %d groups staler than eta=%d and re-issued their questions "
                            "(ExgrpoStalenessAboveEta)", step, dropped, L.max_staleness)
            batch.sort(key=lambda b: b[0].work_id)  # dispatch order, not arrival order: reproducible updates
            t_wait = time.time() - t_step

            # 2) flatten into sequences; an experience group is its replayed trajectory + K-1 fresh samples
            collecting = mixed  # the switch fired at the end of an earlier step
            seqs: list[Seq] = []
            groups = []  # (question id, k correct, group size, prompt ids, policy version)
            rewards, staleness, truncated = [], [], 0
            for gi, (item, g) in enumerate(batch):
                comps = [(c.token_ids, c.logprobs, c.reward, False) for c in g.completions]
                if item.replay is not None:
                    comps.insert(0, (item.replay.token_ids, item.replay.logprobs, float(g.extra["replay_reward"]), True))
                group_rewards = [c[2] for c in comps]
                adv = group_advantages(group_rewards)
                k = sum(1 for r in group_rewards if r >= 1.0)
                groups.append((item.question_id, k, len(comps), g.prompt_ids.tolist(), g.policy_version))
                staleness.append(version - g.policy_version)
                for c in g.completions:
                    totals["verify_timeouts"] += c.verify_status == "timeout"
                    totals["verify_errors"] += c.verify_status == "error"
                    truncated += c.finish_reason == "length"
                for (ids, lps, reward, replay), a in zip(comps, adv):
                    rewards.append(reward)
                    collect = collecting and not replay and reward >= 1.0 and 0 < k < len(comps)
                    seqs.append(Seq(g.prompt_ids.tolist(), ids.tolist(), torch.from_numpy(lps.copy()), a,
                                    version - g.policy_version, gi, replay, collect))
            totals["rollouts"] += len(seqs)
            step_tokens = sum(len(s.completion) for s in seqs if not s.replay)
            totals["tokens"] += step_tokens

            # 3) the update: M mini-batches of B/M groups, each one optimizer step
            t_train = time.time()
            model.train()
            mb_groups = B // L.minibatches_per_step
            clip = L.clip_eps if L.clip_eps > 0 and (not mixed or X.clip_after_switch) else None
            entropy_coef = X.entropy_coef if X.enabled else 0.0
            # The learner's log-probs before this step's update serve twice: as pi_prox of the
            # off-policy correction and as pi_past of trajectories collected for ExGRPO (the authors'
            # choice). Mini-batch 0 reads them from its own forward pass; later mini-batches run after
            # an update, so theirs are recomputed here, without grad, first.
            correcting = L.off_policy_correction != "none"
            pre_logp: dict[int, torch.Tensor] = {}
            late = [i for i, s in enumerate(seqs) if s.group >= mb_groups
                    and ((correcting and not s.replay) or (X.pi_past == "learner" and s.collect))]
            if late:
                pre_logp.update(recompute_logps(model, [seqs[i] for i in late], late, tokenizer.pad_token_id or 0,
                                                device, L.micro_batch_sequences, cfg.rollout.temperature))
            pi_past: dict[int, torch.Tensor] = {}
            kl = {"mismatch": [0.0, 0], "behaviour": [0.0, 0]}  # k3 sums and token counts
            losses, norms, stats_acc, diff_max = [], [], [], None
            for mb in range(L.minibatches_per_step):
                mb_idx = [i for i, s in enumerate(seqs) if mb * mb_groups <= s.group < (mb + 1) * mb_groups]
                normalizer = float(len(mb_idx) * L_max)
                # zero-advantage sequences add nothing to the policy gradient (but to the entropy bonus)
                live = [i for i in mb_idx if seqs[i].advantage != 0.0 or not L.drop_zero_advantage or entropy_coef > 0]
                if step in L.fault_nan_loss_at_steps and not live:  # the drill fires even on an all-zero batch
                    live = mb_idx[:1]
                opt.zero_grad(set_to_none=True)
                mb_loss = 0.0
                for j in range(0, len(live), L.micro_batch_sequences):
                    idx = live[j:j + L.micro_batch_sequences]
                    micro = [seqs[i] for i in idx]
                    packed = pack_sequences([s.prompt for s in micro], [s.completion for s in micro], tokenizer.pad_token_id or 0)
                    mask = packed["target_mask"].to(device)
                    out = token_logprobs(model, packed["input_ids"].to(device), packed["attention_mask"].to(device),
                                         cfg.rollout.temperature, with_entropy=entropy_coef > 0)
                    logp, entropy = out if entropy_coef > 0 else (out, None)
                    behav = scatter_completion([s.logprobs for s in micro], packed["target_mask"]).to(device)
                    replay_rows = torch.tensor([s.replay for s in micro], device=device)
                    if not X.importance_correction and replay_rows.any():  # ablation: pi_past := current recompute
                        behav = torch.where(replay_rows.unsqueeze(-1), logp.detach(), behav)
                    adv = torch.tensor([s.advantage for s in micro], dtype=torch.float32, device=device)
                    if mb == 0:
                        prox = logp.detach()
                    else:  # recomputed before the first update; replayed rows keep their own slot
                        prox = scatter_completion([pre_logp.get(i, s.logprobs) for i, s in zip(idx, micro)],
                                                  packed["target_mask"]).to(device)
                    fresh = (~replay_rows).unsqueeze(-1) & mask
                    # tokens vLLM sampled with the very weights the learner has now: pure numerics
                    own_version = fresh & torch.tensor([s.staleness == 0 for s in micro], device=device).unsqueeze(-1)
                    if mb == 0 or correcting:  # prox is the pre-update policy here
                        for key, m in (("mismatch", own_version), ("behaviour", fresh)):
                            total, n = mismatch_kl(prox, behav, m)
                            kl[key][0] += total
                            kl[key][1] += n
                    if mb == 0 and own_version.any():
                        d_ = float(((prox - behav).abs() * own_version).max())
                        diff_max = d_ if diff_max is None else max(diff_max, d_)
                    loss, st = policy_loss(logp, behav, adv, mask, clip, normalizer,
                                           replay_mask=replay_rows.unsqueeze(-1) & mask if X.enabled else None,
                                           shaping_beta=X.shaping_beta, proximal_logp=prox if correcting else None,
                                           correction=L.off_policy_correction, cap=L.off_policy_cap)
                    if step in L.fault_nan_loss_at_steps:  # fault drill (config)
                        loss = loss * float("nan")
                    if entropy is not None:
                        ent_mean = (entropy * mask).sum() / mask.sum().clamp(min=1)
                        loss = loss - entropy_coef * ent_mean
                        st["entropy"] = float(ent_mean.detach())
                    loss.backward()
                    mb_loss += float(loss.detach())
                    stats_acc.append(st)
                    if X.pi_past == "learner":
                        for r, i in enumerate(idx):
                            if seqs[i].collect:
                                pi_past[i] = prox[r][mask[r]].float().cpu()
                gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), L.grad_clip))
                norms.append(gn)
                losses.append(mb_loss)
                if not math.isfinite(gn) or gn > L.skip_grad_norm:
                    totals["skipped_steps"] += 1
                    log.warning("step %d: grad norm %s, optimizer update skipped", step, gn)
                    opt.zero_grad(set_to_none=True)
                    continue
                opt_updates += 1
                for g_ in opt.param_groups:
                    g_["lr"] = L.lr * min(1.0, opt_updates / L.warmup_steps) if L.warmup_steps else L.lr
                opt.step()
            model.eval()
            t_train = time.time() - t_train

            # 3b) ExGRPO bookkeeping: retire K/K questions, collect correct trajectories of partly solved
            # ones, flip the delayed-start switch, and choose next steps' experience questions
            ex: dict = {}
            if X.enabled:
                newly_retired = set()
                for gi, (qid, k, size, prompt, pv) in enumerate(groups):
                    if X.retire and k == size:
                        buffer.retire(qid)
                        newly_retired.add(qid)
                    elif collecting and 0 < k < size:
                        prompt_ids_of[qid] = prompt
                        correct = [Trajectory(np.asarray(s.completion, np.int32),
                                              (pi_past[i] if X.pi_past == "learner" else s.logprobs).numpy(), pv)
                                   for i, s in enumerate(seqs) if s.group == gi and s.collect]
                        buffer.record(qid, k, correct)
                buffer.end_step()
                dispatcher.retire(newly_retired)
                pass_rate = sum(1.0 for r in rewards if r >= 1.0) / len(rewards)
                if not mixed and pass_rate > X.start_threshold:
                    mixed = True
                    log.info("step %d: batch pass@1 %.3f > %.2f: experience collection and replay start",
                             step, pass_rate, X.start_threshold)
                t_sel = time.time()
                plan = []
                if mixed:
                    in_flight = dispatcher.experience_in_flight()
                    want = int(X.rho * B) - len(in_flight)
                    chosen = [q for q in buffer.sample_questions(want + len(in_flight), X.question_weighting, X.mu,
                                                                 X.sigma, X.units) if q not in in_flight][:max(0, want)]
                    if chosen:
                        plan = select_replays(model, [(q, prompt_ids_of[q], buffer.trajectories(q)) for q in chosen],
                                              X.selection, X.selection_metric, cfg.rollout.temperature, device,
                                              X.selection_batch_sequences, tokenizer.pad_token_id or 0, rng)
                        bucket_at_selection.update({q: buffer.bucket_of(q) for q in chosen})
                        dispatcher.add_experience([(q, t) for q, t, _ in plan], n=K - 1)
                exp_buckets = [bucket_at_selection.get(item.question_id) for item, _ in batch if item.replay is not None]
                rep = [s for s in stats_acc if s.get("replay_tokens")]
                ex = {
                    "exgrpo_mixed": mixed, "buffer_questions": buffer.num_questions,
                    "buffer_trajectories": buffer.num_trajectories, "buffer_tokens": buffer.num_tokens,
                    "retired_total": len(buffer.retired), "buckets": buffer.bucket_sizes(),
                    "experience_questions": len(exp_buckets),
                    "experience_by_bucket": {b: exp_buckets.count(b) for b in sorted(set(exp_buckets), key=str)},
                    "selected_entropy_mean": sum(sc for _, _, sc in plan) / len(plan) if plan else None,
                    "replay_w_mean": sum(s["replay_w_mean"] * s["replay_tokens"] for s in rep) / max(1.0, sum(s["replay_tokens"] for s in rep)) if rep else None,
                    "replay_w_max": max((s["replay_w_max"] for s in rep), default=None),
                    "replay_token_frac": sum(s["replay_tokens"] for s in rep) / max(1.0, sum(s["tokens"] for s in stats_acc)),
                    "selection_seconds": time.time() - t_sel, "buffer_bytes": buffer.nbytes,
                    "entropy": sum(s.get("entropy", 0.0) for s in stats_acc) / max(1, len(stats_acc)),
                }

            # 4) new policy version: publish it, let the dispatcher admit more work
            version += 1
            t_pub = time.time()
            publisher.publish(version, named_parameters_for_sync(model))
            t_pub = time.time() - t_pub
            dispatcher.trained(B, version)
            if not first_sync_checked and diff_max is not None:  # actors' weights all arrived by broadcast
                log.info("after the first weight sync: max |logp_vllm - logp_learner| = %.3g on version %d",
                         diff_max, version - 1)
                first_sync_checked = True

            # 5) metrics
            syncs, n_syncs_seen = server.sync_seconds[n_syncs_seen:], len(server.sync_seconds)
            updates, n_updates_seen = server.update_timings[n_updates_seen:], len(server.update_timings)
            busy_before, busy_seen = busy_seen, dict(server.actor_busy)  # a copy: the server thread writes it
            elapsed = time.time() - t_start
            row = {
                "step": step, "policy_version": version, "reward_mean": sum(rewards) / len(rewards),
                "pass_at_1": sum(1.0 for r in rewards if r >= 1.0) / len(rewards),
                "loss": sum(losses), "grad_norm": max(norms), "tokens_generated": step_tokens, "rollouts": len(seqs),
                "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                "staleness_hist": {str(lag): staleness.count(lag) for lag in sorted(set(staleness))},
                "sync_seconds": sum(syncs) / len(syncs) if syncs else 0.0, "publish_seconds": t_pub,
                "step_seconds": time.time() - t_step, "wait_seconds": t_wait, "train_seconds": t_train,
                "learner_idle_frac": t_wait / max(1e-9, time.time() - t_step),
                "actor_idle_frac": actor_idle_share(busy_before, busy_seen),
                "update_pause_seconds": sum(u["pause"] for u in updates) / len(updates) if updates else None,
                "update_stall_seconds": sum(u["stall"] for u in updates) / len(updates) if updates else None,
                "update_stall_max_seconds": max((u["stall"] for u in updates), default=None),
                "ratio_mean": sum(s["ratio_mean"] for s in stats_acc) / max(1, len(stats_acc)),
                "ratio_max": max((s["ratio_max"] for s in stats_acc), default=1.0),
                "clip_frac": sum(s["clip_frac"] for s in stats_acc) / max(1, len(stats_acc)),
                **is_stats(stats_acc), "mismatch_kl": kl["mismatch"][0] / kl["mismatch"][1] if kl["mismatch"][1] else None,
                "behaviour_kl": kl["behaviour"][0] / kl["behaviour"][1] if kl["behaviour"][1] else None,
                "logprob_diff_max": diff_max, "stale_dropped_total": totals["stale_dropped"],
                "skipped_steps_total": totals["skipped_steps"], "optimizer_updates_total": opt_updates,
                "actors": server.connected,
                "rollouts_per_s": (totals["rollouts"] - rollouts_at_start) / elapsed,
                "tokens_per_s": (totals["tokens"] - tokens_at_start) / elapsed,
                "bad_messages_total": server.counters["bad_messages"], "truncated_frac": truncated / len(seqs),
                "verify_timeouts_total": totals["verify_timeouts"], "verify_errors_total": totals["verify_errors"],
                **ex,
            }
            metrics_f.write(json.dumps(row) + "\n")
            metrics_f.flush()
            if prom is not None:
                prom.observe_step(row, {k: server.counters[k] for k in ("hellos", "actors_lost", "work_reissued",
                                                                          "work_released", "sync_failures")})
            t_progress = time.time()
            if X.enabled and mixed and buffer.num_trajectories == 0:
                empty_buffer_steps += 1
                if empty_buffer_steps % cfg.metrics.buffer_empty_warning_steps == 0:
                    log.warning("experience buffer empty for %d steps after the delayed start: no partly solved "
                                "question has been collected (ExgrpoBufferEmpty)", empty_buffer_steps)
            else:
                empty_buffer_steps = 0
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", stale=f"{row['staleness_mean']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            if json_logs and (time.time() - progress_logged > 30 or step == L.max_steps):
                progress_logged = time.time()
                log.info("step %d/%d: reward %.3f, staleness %.2f, %.0f tokens/s", step, L.max_steps,
                         row["reward_mean"], row["staleness_mean"], row["tokens_per_s"])
            if L.eval_every and step % L.eval_every == 0 and eval_pool and step < L.max_steps:
                ev = run_eval(inbox, dispatcher, len(questions["eval"]), cfg, version)
                metrics_f.write(json.dumps({"step": step, "policy_version": version, "eval": ev}) + "\n")
            if L.checkpoint_every and step % L.checkpoint_every == 0 and step < L.max_steps:
                checkpoint(step)
        bar.close()
        if step >= start_step:  # the final state, for `--resume` with a larger max_steps
            checkpoint(step)
        rl_seconds = time.time() - t_start

        # --- the end: evaluate the final weights, save the model, summarise -----------------------
        if eval_pool:
            summary["after"] = run_eval(inbox, dispatcher, len(questions["eval"]), cfg, version=version)
        save_policy(model, tokenizer, run_dir / "final")
        server.stop()  # no more dispatch: the books below are final
        summary.update(question_books(dispatcher, inbox, server))
        if summary["questions_unaccounted"]:
            log.error("%d training questions were dispatched but neither trained, re-issued nor in flight",
                      summary["questions_unaccounted"])
        summary.update({
            "steps": L.max_steps, "rl_seconds": rl_seconds, "rollouts": totals["rollouts"],
            "rollouts_per_s": (totals["rollouts"] - rollouts_at_start) / rl_seconds,
            "tokens_per_s": (totals["tokens"] - tokens_at_start) / rl_seconds,
            "sync_seconds_mean": sum(server.sync_seconds) / max(1, len(server.sync_seconds)),
            "syncs": len(server.sync_seconds), "stale_dropped": totals["stale_dropped"],
            "update_stall_seconds_mean": (sum(u["stall"] for u in server.update_timings) / len(server.update_timings)
                                          if server.update_timings else None),
            "actors_lost": server.counters["actors_lost"], "work_reissued": server.counters["work_reissued"],
            "work_released": server.counters["work_released"], "rejoin_requests": server.counters["rejoin_requests"],
            "unknown_work": server.counters["unknown_work"], "actors_joined": server.joined,
            "skipped_steps": totals["skipped_steps"], "bad_messages": server.counters["bad_messages"],
            "final_model": str(run_dir / "final"),
        })
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        try:  # the model and the figures are saved: a plotting failure must not fail the run
            log.info("report: %s", write_report(run_dir))
        except Exception:
            log.exception("could not write the run report (`exgrpo-async report %s` retries)", run_dir)
        return summary
    except BaseException as e:
        crashed = not isinstance(e, (SystemExit, KeyboardInterrupt))  # a stop by signal is not a crash
        raise
    finally:
        metrics_f.close()
        server.stop()
        if not crashed:  # a crashed learner leaves its targets listed: down targets are what alerts see
            server.targets.close()
        if prom is not None:
            prom.close()
