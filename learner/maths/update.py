"""The learner's update: a step's sequences in, M optimizer updates out. The maths apart from the process shell.

learner/maths/batch.py `assemble` flattens received groups into `Seq`s (an ExGRPO experience group is its
replayed trajectory in slot 0 plus K-1 fresh samples, one shared baseline); `update_policy` trains on them:
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
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from exgrpo_async.config import RunConfig
from learner.maths.batch import Seq
from learner.maths.collectives import SOLO, Collectives, split_by_tokens
from learner.maths.grpo import mismatch_kl, policy_loss, rows_logprobs
from learner.maths.loss_scale import LossScale
from learner.maths.packing import Rows, layout, micro_batches, to_device
from learner.maths.result import Phase, UpdateResult, finish_result, read_phases

log = logging.getLogger("exgrpo_async.learner")


def forwarded(s: Seq, L) -> bool:
    """Whether the update forwards `s`: a zero-advantage sequence adds nothing to the policy gradient
    (`drop_zero_advantage`), unless the entropy bonus is on (it adds to that)."""
    return s.advantage != 0.0 or not L.drop_zero_advantage or L.entropy_coef > 0


def cut_micro_batches(seqs: list[Seq], idx: list[int], L) -> list[list[int]]:
    """`idx` (positions in `seqs`) in micro-batches, by count or by `max_tokens_per_micro_batch`, shortest
    first: a padded micro-batch then holds sequences of like length (on the toy task 19% fewer padded
    tokens and 20% less forward and backward time than in arrival order, ops/bench/system/learner_pass.py).
    Every loss term is on the mini-batch's scale, so how the sequences are grouped changes nothing but
    float summation order."""
    idx = sorted(idx, key=lambda i: (len(seqs[i].prompt) + len(seqs[i].completion), i))
    parts = micro_batches([len(seqs[i].prompt) + len(seqs[i].completion) for i in idx], L.micro_batch_sequences,
                          L.max_tokens_per_micro_batch)
    return [[idx[k] for k in part] for part in parts]


def _rows(micro: list[Seq], pad_id: int, L) -> Rows:
    return layout([s.prompt for s in micro], [s.completion for s in micro], pad_id, L.max_tokens_per_micro_batch)


@torch.no_grad()
def recompute_logps(model, seqs: list[Seq], keys: list[int], pad_id: int, device, L, temperature: float,
                    passes: int | None = None, filler: Seq | None = None) -> dict:
    """Per-completion log-probs under the model as it is now (before the step's first update), in the
    learner's micro-batches, left on the compute device (the later mini-batches read them there). With
    `passes` (sharded ranks: every rank makes the same number of forward passes), passes beyond this
    rank's own work forward `filler` and discard it."""
    out = {}
    parts = cut_micro_batches(seqs, list(range(len(seqs))), L)
    for p in range(passes if passes is not None else len(parts)):
        part = parts[p] if p < len(parts) else []
        rows = _rows([seqs[k] for k in part] or [filler], pad_id, L)
        logp = rows_logprobs(model, rows, device, temperature, bf16=L.mixed_precision == "bf16")
        if part:
            for k, v in zip(part, rows.split(logp.float())):
                out[keys[k]] = v
    return out


@dataclass
class StepSettings:
    """What the loop decides per step: the clip (None: off) and whether a NaN fault drill fires."""

    clip: float | None
    nan_drill: bool = False


def update_policy(model: torch.nn.Module, opt: torch.optim.Optimizer, seqs: list[Seq], n_groups: int,
                  cfg: RunConfig, settings: StepSettings, device: torch.device, pad_id: int,
                  updates_before: int, ranks: Collectives = SOLO) -> UpdateResult:
    """Train on one step's sequences: `minibatches_per_step` optimizer updates over groups in order.

    On several ranks every rank gets all of `seqs` and forwards its share of each mini-batch (split by
    tokens, `split_by_tokens`); all ranks make the same number of forward/backward passes (a rank whose
    share ran out forwards a filler sequence with zero loss), gradients are summed over ranks (FSDP2 with
    a divide factor of 1; the loss is already on the mini-batch's global scale), and the results are
    reduced so the lead's `UpdateResult` is the whole step's."""
    L, X = cfg.learner, cfg.exgrpo
    res = UpdateResult()
    mb_groups = n_groups // L.minibatches_per_step
    correcting = L.off_policy_correction != "none"
    plan = [_minibatch_plan(seqs, mb, mb_groups, L, settings, ranks.world) for mb in range(L.minibatches_per_step)]
    late = [[i for mb_idx, shares in plan[1:] for i in shares[r] if _needs_pre_logp(seqs[i], correcting, X.pi_past)]
            for r in range(ranks.world)]
    passes = max(len(cut_micro_batches(seqs, x, L)) for x in late)
    mine = late[ranks.rank]
    with Phase(res, "recompute", device):
        pre_logp = recompute_logps(model, [seqs[i] for i in mine], mine, pad_id, device, L, cfg.rollout.temperature,
                                   passes, filler=seqs[0] if seqs else None) if passes else {}
    for mb, (mb_idx, shares) in enumerate(plan):
        update = OptimizerUpdate(model, opt, cfg, settings, device, pad_id, res,
                                 LossScale(len(mb_idx), cfg.rollout.max_new_tokens), mb, pre_logp)
        micro = [cut_micro_batches(seqs, x, L) for x in shares]
        for j in range(max(len(m) for m in micro)):
            idx = micro[ranks.rank][j] if j < len(micro[ranks.rank]) else []
            if idx:
                update.micro(seqs, idx)
            else:  # this rank's share ran out: join the pass's collectives with a zero-loss filler
                update.filler(seqs[min(mb_idx, key=lambda i: len(seqs[i].completion))])
        update.step(updates_before + res.updates, ranks)
    read_phases(res)
    finish_result(res)
    if ranks.world > 1:
        _reduce_result(res, ranks)
    return res


class OptimizerUpdate:
    """One optimizer update: micro-batches' losses and gradients accumulated on one `LossScale`, then the
    step. The one route from sequences to an optimizer step: `update_policy` makes one per mini-batch,
    learner/overlap.py's `Accumulator` one per step, fed as the groups arrive."""

    def __init__(self, model, opt, cfg: RunConfig, settings: StepSettings, device, pad_id: int, res: UpdateResult,
                 scale: LossScale, mb: int = 0, pre_logp: dict | None = None):
        self.model, self.opt, self.cfg, self.settings, self.device = model, opt, cfg, settings, device
        self.pad_id, self.res, self.scale, self.mb, self.pre_logp = pad_id, res, scale, mb, pre_logp or {}
        self.loss = torch.zeros((), device=device)
        self.micro_batches = 0
        opt.zero_grad(set_to_none=True)

    def micro(self, seqs: list[Seq], idx: list[int]) -> None:
        """Forward, loss and backward of the sequences `idx` of `seqs` (`micro_step`)."""
        self.loss += micro_step(self.model, seqs, idx, self.mb, self.pre_logp, self.scale, self.cfg, self.settings,
                                self.device, self.pad_id, self.res)
        self.micro_batches += 1

    def filler(self, s: Seq) -> None:
        with Phase(self.res, "forward", self.device):
            _filler_step(self.model, s, self.cfg, self.device, self.pad_id)

    def step(self, updates_before: int, ranks: Collectives = SOLO) -> None:
        """The mini-batch's loss recorded; the gradient summed where ranks replicate, clipped and applied."""
        self.res.losses.append(self.loss)
        with Phase(self.res, "optimizer", self.device):
            if ranks.world > 1:
                sum_replicated_grads(self.model)
            optimizer_step(self.model, self.opt, self.cfg.learner, updates_before, self.res)


def _minibatch_plan(seqs: list[Seq], mb: int, mb_groups: int, L, settings: StepSettings,
                    world: int) -> tuple[list[int], list[list[int]]]:
    """A mini-batch's sequences, and the forwarded ones dealt to the ranks by tokens."""
    mb_idx = [i for i, s in enumerate(seqs) if mb * mb_groups <= s.group < (mb + 1) * mb_groups]
    live = [i for i in mb_idx if forwarded(seqs[i], L)]
    if settings.nan_drill and not live:  # the drill fires even on an all-zero batch
        live = mb_idx[:1]
    shares = split_by_tokens([len(seqs[i].prompt) + len(seqs[i].completion) for i in live], world)
    return mb_idx, [[live[k] for k in share] for share in shares]


def _needs_pre_logp(s: Seq, correcting: bool, pi_past: str) -> bool:
    """A forwarded sequence of a mini-batch after the first needs its pre-update log-probs: as pi_prox
    (fresh tokens, staleness correction) or as pi_past (collected by ExGRPO)."""
    return (correcting and not s.replay) or (pi_past == "learner" and s.collect)


def _filler_step(model, s: Seq, cfg: RunConfig, device, pad_id: int) -> None:
    """A forward/backward with zero loss, so this rank joins the collectives of a pass it has no work for."""
    logp = rows_logprobs(model, _rows([s], pad_id, cfg.learner), device, cfg.rollout.temperature,
                         bf16=cfg.learner.mixed_precision == "bf16")
    (logp.sum() * 0.0).backward()


def _reduce_result(res: UpdateResult, ranks: Collectives) -> None:
    """Make the lead's result the whole step's: loss sums, KL sums, max diff, micro-batch stats, pi_past."""
    res.losses = ranks.sum(res.losses)
    kl = ranks.sum([res.kl["mismatch"][0], res.kl["mismatch"][1], res.kl["behaviour"][0], res.kl["behaviour"][1]])
    res.kl = {"mismatch": [kl[0], int(kl[1])], "behaviour": [kl[2], int(kl[3])]}
    d = ranks.max([res.diff_max if res.diff_max is not None else -1.0])[0]
    res.diff_max = d if d >= 0 else None
    parts = ranks.gather({"stats": res.stats,
                          "pi_past": {i: t.numpy().astype("float32").tobytes() for i, t in res.pi_past.items()}})
    res.stats = [st for p in parts for st in p["stats"]]
    res.pi_past = {int(i): torch.frombuffer(bytearray(b), dtype=torch.float32) for p in parts
                   for i, b in p["pi_past"].items()}


def micro_step(model, seqs: list[Seq], idx: list[int], mb: int, pre_logp: dict, scale: LossScale, cfg: RunConfig,
               settings: StepSettings, device, pad_id: int, res: UpdateResult) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; returns its loss (already on the mini-batch's scale) as
    a 0-d tensor. Nothing here waits for the device: what each sequence is (replayed, the learner's own
    version) is known on the host, inputs go over from pinned memory, statistics stay tensors until
    `finish_result` reads the whole step's at once."""
    L, X = cfg.learner, cfg.exgrpo
    with Phase(res, "forward", device):
        micro = [seqs[i] for i in idx]
        rows = _rows(micro, pad_id, L)
        mask = to_device(rows.target_mask, device)
        with_entropy = L.entropy_coef > 0
        out = rows_logprobs(model, rows, device, cfg.rollout.temperature, with_entropy, bf16=L.mixed_precision == "bf16")
        logp, entropy = out if with_entropy else (out, None)
        behav = to_device(rows.place([s.logprobs for s in micro]), device)
        any_replay = any(s.replay for s in micro)
        replay_tok = to_device(rows.per_token(torch.tensor([s.replay for s in micro])), device)  # replayed tokens
        if not X.importance_correction and any_replay:  # ablation: pi_past := current recompute
            behav = torch.where(replay_tok, logp.detach(), behav)
        adv = to_device(rows.per_token(torch.tensor([s.advantage for s in micro], dtype=torch.float32)), device)
        if mb == 0:
            prox = logp.detach()
        else:  # recomputed before the first update; replayed rows keep their own slot
            prox = rows.place([pre_logp.get(i, s.logprobs) for i, s in zip(idx, micro)], device)
        correcting = L.off_policy_correction != "none"
        own = [s.staleness == 0 for s in micro]
        own_version = to_device(rows.per_token(torch.tensor(own)), device)
        _mismatch_stats(prox, behav, mask, replay_tok, own_version, mb == 0 or correcting, mb == 0 and any(own), res)
        loss, st = policy_loss(logp, behav, adv, mask, settings.clip, scale.denominator,
                               replay_mask=replay_tok if any_replay else None,
                               shaping_beta=X.shaping_beta, proximal_logp=prox if correcting else None,
                               correction=L.off_policy_correction, cap=L.off_policy_cap,
                               segments=to_device(rows.seq_index, device), n_segments=len(micro))
        if settings.nan_drill:  # fault drill (config)
            loss = loss * float("nan")
        if entropy is not None:
            loss = loss - L.entropy_coef * scale.reduce(entropy, mask)
            st["entropy_sum"] = (entropy.detach() * mask).sum()
    with Phase(res, "backward", device):
        loss.backward()
    res.stats.append(st)
    if X.pi_past == "learner" and any(s.collect for s in micro):
        for i, v in zip(idx, rows.split(prox)):
            if seqs[i].collect:
                res.pi_past[i] = v.float()  # to the host in finish_result
    return loss.detach()


def _mismatch_stats(prox, behav, mask, replay_tok, own_version_tok, kl_valid: bool, diff: bool,
                    res: UpdateResult) -> None:
    """KL(pi_behav || pi_prox) over fresh tokens, and over tokens sampled with the learner's own version
    (pure numerics), while prox is the pre-update policy; with `diff` (the first mini-batch, some sequence
    of the learner's own version in it) the max |logp diff| on the latter. All 0-d tensors."""
    fresh = ~replay_tok & mask
    own_version = fresh & own_version_tok
    if kl_valid:
        for key, m in (("mismatch", own_version), ("behaviour", fresh)):
            total, n = mismatch_kl(prox, behav, m)
            res.kl[key][0] = res.kl[key][0] + total
            res.kl[key][1] = res.kl[key][1] + n
    if diff:
        d_ = torch.where(own_version, (prox - behav).abs(), torch.full_like(prox, -1.0)).max()
        res.diff_max = d_ if res.diff_max is None else torch.maximum(torch.as_tensor(res.diff_max), d_)


def sum_replicated_grads(model: torch.nn.Module) -> None:
    """Sharded ranks: sum over the ranks the gradients of the parameters FSDP2 does not shard (the layers'
    norms in bf16, learner/policy.py `shard`), in one flat fp32 all-reduce, as FSDP2 sums the others."""
    params = [p for p in model.parameters() if not isinstance(p, DTensor)]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p).clone()


def _total_norm(sharded: list[torch.nn.Parameter], plain: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the whole gradient: of the sharded parameters' (DTensors: the norm over every rank's
    shards, on every rank) and of the plain ones' (whole on this rank) together."""
    parts = [torch.nn.utils.get_total_norm([p.grad for p in sharded], 2.0).full_tensor()] if sharded else []
    parts += [torch.nn.utils.get_total_norm([p.grad for p in plain], 2.0)] if plain else []
    if not parts:
        return torch.zeros(())
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)


def optimizer_step(model, opt, L, updates_so_far: int, res: UpdateResult) -> None:
    """Clip, check and apply the accumulated gradient (or skip and count it)."""
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    norm = _total_norm(sharded, plain)
    for group in (sharded, plain):  # one clip cannot take DTensors and plain tensors together
        torch.nn.utils.clip_grads_with_norm_(group, L.grad_clip, norm)
    gn = float(norm)
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
