"""The learner's update: a step's groups in, M optimizer updates out. The maths apart from the process shell.

`assemble` flattens received groups into `Seq`s (an ExGRPO experience group is its replayed trajectory
in slot 0 plus K-1 fresh samples, one shared baseline); `update_policy` trains on them:
- the step's groups are cut into M mini-batches (one optimizer update each) and each mini-batch into
  micro-batches (memory only: every loss term is on the mini-batch's `LossScale`, so any micro-batch size
  gives the same loss and gradient);
- the learner's own log-probs before the update serve twice: as pi_prox of the staleness correction and
  as pi_past of trajectories ExGRPO collects (the authors' choice). Mini-batch 0 reads them from its own
  forward pass; later mini-batches run after an update, so theirs are recomputed first, without grad;
- zero-advantage sequences add nothing to the policy gradient and are not forwarded (unless the entropy
  bonus is on: they add to it);
- an update whose grad norm is non-finite or above `skip_grad_norm` is skipped and counted.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import torch

from exgrpo_async.config import RunConfig
from exgrpo_async.rollout import RolloutGroup
from learner.dispatch import WorkItem
from learner.grpo import group_advantages, mismatch_kl, pack_sequences, policy_loss, scatter_completion, token_logprobs
from learner.loss_scale import LossScale

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


@dataclass
class Group:
    """One group of the step, for ExGRPO's bookkeeping and the metrics."""

    question_id: int
    k: int  # correct responses, the replayed one included
    size: int
    prompt: list[int]
    policy_version: int
    replay: object = None  # the replayed Trajectory, if an experience group


@dataclass
class Batch:
    seqs: list[Seq]
    groups: list[Group]
    fresh_rewards: list[float]  # every fresh completion
    replay_rewards: list[float]
    experience_fresh_rewards: list[float]  # the K-1 fresh completions of experience groups (a subset)
    staleness: list[int]
    truncated: int
    fresh_tokens: int
    verify_timeouts: int
    verify_errors: int


def minibatch_order(batch: list[tuple[WorkItem, RolloutGroup]], rng: random.Random) -> list:
    """The step's groups in a seeded random order (mini-batch m takes the m-th slice): experience items,
    dispatched first, would otherwise all land in the first optimizer update. Sorted by work id first,
    so the order depends on the seed, not on arrival."""
    out = sorted(batch, key=lambda b: b[0].work_id)
    rng.shuffle(out)
    return out


def assemble(batch: list[tuple[WorkItem, RolloutGroup]], version: int, collecting: bool) -> Batch:
    """Flatten groups into sequences with their advantages; mark correct ones of partly solved groups
    for collection when `collecting` (ExGRPO's delayed start has fired)."""
    seqs: list[Seq] = []
    out = Batch(seqs, [], [], [], [], [], 0, 0, 0, 0)
    for gi, (item, g) in enumerate(batch):
        comps = [(c.token_ids, c.logprobs, c.reward, False) for c in g.completions]
        if item.replay is not None:
            comps.insert(0, (item.replay.token_ids, item.replay.logprobs, float(g.extra["replay_reward"]), True))
        rewards = [c[2] for c in comps]
        k = sum(1 for r in rewards if r >= 1.0)
        out.groups.append(Group(item.question_id, k, len(comps), g.prompt_ids.tolist(), g.policy_version, item.replay))
        out.staleness.append(version - g.policy_version)
        for c in g.completions:
            out.verify_timeouts += c.verify_status == "timeout"
            out.verify_errors += c.verify_status == "error"
            out.truncated += c.finish_reason == "length"
            out.fresh_tokens += len(c.token_ids)
        for (ids, lps, reward, replay), a in zip(comps, group_advantages(rewards)):
            (out.replay_rewards if replay else out.fresh_rewards).append(reward)
            if item.replay is not None and not replay:
                out.experience_fresh_rewards.append(reward)
            collect = collecting and not replay and reward >= 1.0 and 0 < k < len(comps)
            seqs.append(Seq(g.prompt_ids.tolist(), ids.tolist(), torch.from_numpy(lps.copy()), a,
                            version - g.policy_version, gi, replay, collect))
    return out


@torch.no_grad()
def recompute_logps(model, seqs: list[Seq], keys: list[int], pad_id: int, device, batch: int, temperature: float,
                    bf16: bool = False) -> dict:
    """Per-completion log-probs under the model as it is now (before the step's first update)."""
    out = {}
    for j in range(0, len(seqs), batch):
        chunk = seqs[j:j + batch]
        packed = pack_sequences([s.prompt for s in chunk], [s.completion for s in chunk], pad_id)
        logp = token_logprobs(model, packed["input_ids"].to(device), packed["attention_mask"].to(device), temperature,
                              bf16=bf16)
        for r, key in enumerate(keys[j:j + batch]):
            out[key] = logp[r][packed["target_mask"][r].to(device)].float().cpu()
    return out


@dataclass
class UpdateResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer update (mini-batch)
    norms: list[float] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)  # one per micro-batch
    kl: dict = field(default_factory=lambda: {"mismatch": [0.0, 0], "behaviour": [0.0, 0]})  # k3 sums, tokens
    diff_max: float | None = None  # max |logp_vllm - logp_learner| on tokens of the learner's own version
    pi_past: dict[int, torch.Tensor] = field(default_factory=dict)  # seq index -> pre-update log-probs
    updates: int = 0  # optimizer updates made
    skipped: int = 0  # optimizer updates skipped (bad grad norm)


@dataclass
class StepSettings:
    """What the loop decides per step: the clip (None: off) and whether a NaN fault drill fires."""

    clip: float | None
    nan_drill: bool = False


def update_policy(model: torch.nn.Module, opt: torch.optim.Optimizer, seqs: list[Seq], n_groups: int,
                  cfg: RunConfig, settings: StepSettings, device: torch.device, pad_id: int,
                  updates_before: int) -> UpdateResult:
    """Train on one step's sequences: `minibatches_per_step` optimizer updates over groups in order."""
    L, X = cfg.learner, cfg.exgrpo
    res = UpdateResult()
    mb_groups = n_groups // L.minibatches_per_step
    correcting = L.off_policy_correction != "none"
    late = _late(seqs, mb_groups, correcting, X.pi_past)
    pre_logp = recompute_logps(model, [seqs[i] for i in late], late, pad_id, device, L.micro_batch_sequences,
                               cfg.rollout.temperature, L.mixed_precision == "bf16") if late else {}
    for mb in range(L.minibatches_per_step):
        mb_idx = [i for i, s in enumerate(seqs) if mb * mb_groups <= s.group < (mb + 1) * mb_groups]
        scale = LossScale(len(mb_idx), cfg.rollout.max_new_tokens)
        live = [i for i in mb_idx if seqs[i].advantage != 0.0 or not L.drop_zero_advantage or L.entropy_coef > 0]
        if settings.nan_drill and not live:  # the drill fires even on an all-zero batch
            live = mb_idx[:1]
        opt.zero_grad(set_to_none=True)
        mb_loss = 0.0
        for j in range(0, len(live), L.micro_batch_sequences):
            idx = live[j:j + L.micro_batch_sequences]
            mb_loss += _micro_step(model, seqs, idx, mb, pre_logp, scale, cfg, settings, device, pad_id, res)
        res.losses.append(mb_loss)
        _optimizer_step(model, opt, L, updates_before + res.updates, res)
    return res


def _late(seqs: list[Seq], mb_groups: int, correcting: bool, pi_past: str) -> list[int]:
    """Sequences of mini-batches after the first whose pre-update log-probs are needed."""
    return [i for i, s in enumerate(seqs) if s.group >= mb_groups
            and ((correcting and not s.replay) or (pi_past == "learner" and s.collect))]


def _micro_step(model, seqs: list[Seq], idx: list[int], mb: int, pre_logp: dict, scale: LossScale, cfg: RunConfig,
                settings: StepSettings, device, pad_id: int, res: UpdateResult) -> float:
    """Forward, loss and backward of one micro-batch; returns its loss (already on the mini-batch's scale)."""
    L, X = cfg.learner, cfg.exgrpo
    micro = [seqs[i] for i in idx]
    packed = pack_sequences([s.prompt for s in micro], [s.completion for s in micro], pad_id)
    mask = packed["target_mask"].to(device)
    with_entropy = L.entropy_coef > 0
    out = token_logprobs(model, packed["input_ids"].to(device), packed["attention_mask"].to(device),
                         cfg.rollout.temperature, with_entropy=with_entropy, bf16=L.mixed_precision == "bf16")
    logp, entropy = out if with_entropy else (out, None)
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
    correcting = L.off_policy_correction != "none"
    _mismatch_stats(prox, behav, mask, replay_rows, micro, mb == 0 or correcting, mb == 0, device, res)
    replay_mask = replay_rows.unsqueeze(-1) & mask if bool(replay_rows.any()) else None
    loss, st = policy_loss(logp, behav, adv, mask, settings.clip, scale.denominator, replay_mask=replay_mask,
                           shaping_beta=X.shaping_beta, proximal_logp=prox if correcting else None,
                           correction=L.off_policy_correction, cap=L.off_policy_cap)
    if settings.nan_drill:  # fault drill (config)
        loss = loss * float("nan")
    if entropy is not None:
        loss = loss - L.entropy_coef * scale.reduce(entropy, mask)
        st["entropy_sum"] = float((entropy.detach() * mask).sum())
    loss.backward()
    res.stats.append(st)
    if X.pi_past == "learner":
        for r, i in enumerate(idx):
            if seqs[i].collect:
                res.pi_past[i] = prox[r][mask[r]].float().cpu()
    return float(loss.detach())


def _mismatch_stats(prox, behav, mask, replay_rows, micro: list[Seq], kl_valid: bool, first: bool, device,
                    res: UpdateResult) -> None:
    """KL(pi_behav || pi_prox) over fresh tokens, and over tokens sampled with the learner's own version
    (pure numerics), while prox is the pre-update policy; max |logp diff| on the latter."""
    fresh = (~replay_rows).unsqueeze(-1) & mask
    own_version = fresh & torch.tensor([s.staleness == 0 for s in micro], device=device).unsqueeze(-1)
    if kl_valid:
        for key, m in (("mismatch", own_version), ("behaviour", fresh)):
            total, n = mismatch_kl(prox, behav, m)
            res.kl[key][0] += total
            res.kl[key][1] += n
    if first and own_version.any():
        d_ = float(((prox - behav).abs() * own_version).max())
        res.diff_max = d_ if res.diff_max is None else max(res.diff_max, d_)


def _optimizer_step(model, opt, L, updates_so_far: int, res: UpdateResult) -> None:
    """Clip, check and apply the accumulated gradient (or skip and count it)."""
    gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), L.grad_clip))
    res.norms.append(gn)
    if not math.isfinite(gn) or gn > L.skip_grad_norm:
        res.skipped += 1
        log.warning("grad norm %s, optimizer update skipped", gn)
        opt.zero_grad(set_to_none=True)
        return
    res.updates += 1
    n = updates_so_far + 1
    for g_ in opt.param_groups:
        g_["lr"] = L.lr * min(1.0, n / L.warmup_steps) if L.warmup_steps else L.lr
    opt.step()
