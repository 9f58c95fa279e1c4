"""The trained policy on this learner rank, and the operations all ranks run on it together.

fp32 master weights and AdamW state; compute in bf16 under autocast with `learner.mixed_precision="bf16"`,
one rank's matmul weights cast to bf16 once per optimizer update (learner/maths/working_weights.py).
With `learner.world_size` > 1 the model is sharded with FSDP2 (`fully_shard` on every decoder layer, then
on the `LogProbs` root that holds embeddings, final norm and output head; with bf16 the layers' linear
weights are gathered in bf16 and the rest in fp32, as one rank's autocast computes: `shard`; fp32
gradient reduction; gradients summed over ranks, since every rank's loss is already on the step's global
scale).

With several ranks only the lead reads the checkpoint; the others build the model on the meta device
and receive their shards from it (`receive_weights`), so no rank but the lead ever holds the whole model.

Every operation below is collective: the lead calls it (announcing it to the followers first) and each
follower runs it from `follow()`, with the same arguments:
- update: one step's optimizer updates (learner/maths/update.py, the batch split over ranks by tokens);
- score: ExGRPO's selection pass, each rank scoring its share of the stored trajectories;
- publish: the weights gathered parameter by parameter, a bucket at a time, into the publisher's
  persistent buffers on the lead (never the whole model twice on any rank);
- state / load: the full model and optimizer state on the lead (checkpoints, the export), and back
  (broadcast from the lead), keyed by parameter name, so a checkpoint resumes into any world size.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from exgrpo_async.config import RunConfig
from exgrpo_async.seams import WeightSender
from exgrpo_async.weight_sync import full_tensor, plan_buckets
from learner.maths import attention, compiled
from learner.maths.batch import Seq
from learner.maths.collectives import split_by_tokens
from learner.maths.grpo import LogProbs, check_no_cross_attention
from learner.maths.packing import micro_batches
from learner.maths.replay import score_trajectories
from learner.maths.result import UpdateResult
from learner.maths.update import StepSettings, update_policy
from learner.maths.working_weights import WorkingWeights
from learner.model import load_policy, materialize, named_parameters_for_sync, policy_skeleton
from learner.ranks import Ranks

log = logging.getLogger("exgrpo_async.learner")


def shard(model: torch.nn.Module, mixed_precision: str, compiled_head: bool = False) -> LogProbs:
    """FSDP2 over the default process group: each decoder layer a unit, the `LogProbs` root the last.

    With bf16 the ranks compute as one rank does under autocast (learner/maths/grpo.py), so 1 and N ranks
    train alike: a layer's linear weights and biases are gathered in bf16 (autocast would cast them
    to bf16 for each matmul: the same rounding), while its norms, the embeddings and the head stay fp32
    (autocast leaves a norm's weight fp32 and casts the head for its matmul) and the residual stream
    stays fp32 (`cast_forward_inputs=False`). Gradients are reduced in fp32. FSDP2's usual bf16 policy
    instead casts every parameter and each layer's input to bf16: the loss of a one-step run differed by
    5% between 1 and 2 ranks. The layers' norms are replicated, not sharded (FSDP2 ignores them: a few
    KB a layer): a unit of their own would put FSDP2's hooks inside the layer, where they break a
    compiled layer's graph. learner/maths/update.py sums their gradients over the ranks (`sum_replicated_grads`)
    and `param_groups` gives them an optimizer group of their own (plain tensors beside DTensors)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: cannot shard it over learner ranks")
    fp32 = MixedPrecisionPolicy()
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
          if mixed_precision == "bf16" else fp32)
    for layer in layers:
        norms = {p for m in layer.modules() if _is_norm(m) for p in m.parameters()}
        fully_shard(layer, mp_policy=mp, ignored_params=norms if mixed_precision == "bf16" else None)
    root = fully_shard(LogProbs(model, compiled_head), mp_policy=fp32)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: each rank's loss is on the global scale
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return root


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The optimizer's parameter groups: the sharded parameters (DTensors), and the replicated ones (plain
    tensors: a sharded bf16 learner's layer norms, `shard`) in a group of their own, since one fused or
    foreach update cannot take both. A checkpoint's optimizer state is keyed by parameter name, so it
    loads into either grouping (1 rank or N)."""
    params = list(model.parameters())
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": g} for g in (sharded, plain) if g]


def receive_weights(model: torch.nn.Module, path: str, ranks: Ranks, device: torch.device) -> None:
    """Fill a sharded skeleton (learner/model.py `policy_skeleton`, then `shard`) with the checkpoint at
    `path`, on every rank together: the lead reads it on its CPU (the one whole copy of the model on the
    node) and broadcasts it a tensor at a time; each rank keeps its shard on `device`. A rank's peak is
    then its shards plus the largest tensor in transit, not the whole model."""
    materialize(model, device)
    weights = load_policy(path, "float32", torch.device("cpu"))[0].state_dict() if ranks.lead else {}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _is_norm(m: torch.nn.Module) -> bool:
    """A normalisation layer (RMSNorm, LayerNorm): its weight scales activations elementwise."""
    return isinstance(m, torch.nn.LayerNorm) or "norm" in type(m).__name__.lower()


class Policy:
    def __init__(self, cfg: RunConfig, ranks: Ranks, device: torch.device):
        L = cfg.learner
        if "auto" in (cfg.model.dtype, L.mixed_precision):
            raise ValueError('model.dtype / learner.mixed_precision "auto" reached the learner unresolved: '
                             "exgrpo_async.precision.resolve chooses them for the machine first")
        self.cfg, self.ranks, self.device = cfg, ranks, device
        # fp32 master weights; with several ranks only the lead reads them, the others build the model's
        # shape on the meta device and receive their shards (`receive_weights`)
        if ranks.world > 1:
            self.model, self.tokenizer = policy_skeleton(cfg.model.path)
        else:
            self.model, self.tokenizer = load_policy(cfg.model.path, "float32", device)
        self.bf16 = L.mixed_precision == "bf16"
        self.attention = attention.resolve(L.attention, device, self.bf16)
        self.compiled = compiled.resolve(L.compile, device, L.gradient_checkpointing, self.attention)
        # compiled layers take the attention into their graph as one traceable op where it pays, and must
        # under checkpointing (the checkpoint sits in the graph)
        in_graph = compiled.attention_in_graph(self.compiled, L.gradient_checkpointing, self.attention)
        attention.use(self.model, self.attention, traceable=in_graph)
        if L.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.compiled.layers:
            compiled.compile_layers(self.model, checkpointed=L.gradient_checkpointing)
        # one rank computing in bf16: its matmuls' weights cast once per update (learner/maths/working_weights.py);
        # sharded ranks gather theirs in bf16 (`shard`)
        self.working = WorkingWeights(self.model) if self.bf16 and ranks.world == 1 else None
        self.forward = (shard(self.model, L.mixed_precision, self.compiled.head) if ranks.world > 1
                        else LogProbs(self.model, self.compiled.head, self.working))
        if ranks.world > 1:
            receive_weights(self.model, cfg.model.path, ranks, device)
        # fused: one kernel for the whole update on a GPU (foreach on CPU, where there is no fused kernel to gain)
        self.opt = torch.optim.AdamW(param_groups(self.model), lr=L.lr, betas=L.betas, weight_decay=L.weight_decay,
                                     fused=device.type == "cuda")
        self.pad_id = self.tokenizer.pad_token_id or 0
        check_no_cross_attention(self.forward, self.model.config.vocab_size, device, self.bf16)
        log.info("learner attention: %s; compiled regions: %s", self.attention, self.compiled)

    # ------------------------------------------------------------------ the collective operations
    def update(self, seqs: list[Seq], n_groups: int, settings: StepSettings, updates_before: int) -> UpdateResult:
        payload = {} if self.ranks.world == 1 else {  # no encoding on one rank's step
            "seqs": [_encode_seq(s) for s in seqs], "n_groups": n_groups, "clip": settings.clip,
            "nan_drill": settings.nan_drill, "updates_before": updates_before}
        self.model.train()
        try:
            with self.ranks.together("update", payload):
                return update_policy(self.forward, self.opt, seqs, n_groups, self.cfg, settings, self.device,
                                     self.pad_id, updates_before, self.ranks)
        finally:
            self.model.eval()

    @torch.no_grad()
    def score(self, prompts: list[list[int]], completions: list[list[int]], metric: str) -> list[float]:
        """Mean per-token entropy (or NLL) of each completion given its prompt under the current weights."""
        with self.ranks.together("score", {"prompts": prompts, "completions": completions, "metric": metric}):
            return self._score(prompts, completions, metric)

    def _score(self, prompts: list[list[int]], completions: list[list[int]], metric: str) -> list[float]:
        if not completions:
            return []
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        shares = split_by_tokens(lengths, self.ranks.world)
        batch, budget = self.cfg.exgrpo.selection_batch_sequences, self.cfg.learner.max_tokens_per_micro_batch
        passes = max(len(micro_batches([lengths[i] for i in s], batch, budget)) for s in shares)
        mine = shares[self.ranks.rank]
        local = score_trajectories(self.forward, [prompts[i] for i in mine], [completions[i] for i in mine], metric,
                                   self.cfg.rollout.temperature, self.device, batch, self.pad_id, self.bf16,
                                   passes=passes, filler=(prompts[0], completions[0]), max_tokens=budget)
        if hasattr(self.forward, "reshard"):  # FSDP2 keeps the root gathered after a forward (for backward)
            self.forward.reshard()
        out = [0.0] * len(completions)
        for share, scores in zip(shares, self.ranks.gather(local)):
            for i, sc in zip(share, scores):
                out[i] = sc
        return out

    def publish(self, publisher: WeightSender | None, version: int, dtype: torch.dtype) -> None:
        """Lead: pack the weights into the publisher's buffers as `version`; followers join the gathers."""
        with self.ranks.together("publish", {"version": version}):
            self._publish(publisher, version, dtype)

    def _publish(self, publisher: WeightSender | None, version: int, dtype: torch.dtype) -> None:
        named = named_parameters_for_sync(self.model)
        if publisher is not None:
            publisher.publish(version, named, dtype)  # gathers sharded parameters one at a time
            return
        by_name = dict(named)  # a follower: the same gathers in the publisher's order, results dropped
        for bucket in plan_buckets(named, self.cfg.weight_sync.bucket_mb << 20, dtype):
            for name, _, _ in bucket:
                full_tensor(by_name[name])

    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """The whole model (and optimizer) state on the lead's CPU, by parameter name; empty elsewhere."""
        with self.ranks.together("state", {"optimizer": optimizer}):
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.model, options=opts)
            return weights, (get_optimizer_state_dict(self.model, self.opt, options=opts) if optimizer else None)

    def load_state(self, weights: dict, optim: dict | None) -> None:
        """Load a full state read on the lead (followers pass empty dicts); broadcast from the lead."""
        with self.ranks.together("load", {"optimizer": optim is not None}):
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.ranks.world > 1, strict=False)
            set_model_state_dict(self.model, weights, options=opts)
            if optim is not None:
                set_optimizer_state_dict(self.model, self.opt, optim, options=opts)

    def stop(self) -> None:
        self.ranks.announce("stop", {})

    # ------------------------------------------------------------------ followers
    def follow(self) -> None:
        """A follower rank's whole life: run what the lead announces until it says stop."""
        while True:
            op, p = self.ranks.receive()
            if op == "update":
                settings = StepSettings(clip=p["clip"], nan_drill=p["nan_drill"])
                self.model.train()
                update_policy(self.forward, self.opt, [_decode_seq(s) for s in p["seqs"]], p["n_groups"], self.cfg,
                              settings, self.device, self.pad_id, p["updates_before"], self.ranks)
                self.model.eval()
            elif op == "score":
                self.score(p["prompts"], p["completions"], p["metric"])
            elif op == "publish":
                self.publish(None, p["version"], getattr(torch, self.cfg.model.dtype))
            elif op == "state":
                self.full_state(p["optimizer"])
            elif op == "load":
                self.load_state({}, {} if p["optimizer"] else None)
            elif op == "stop":
                return
            else:
                raise ValueError(f"learner rank {self.ranks.rank}: unknown operation {op!r} from the lead")


def _encode_seq(s: Seq) -> dict:
    return {"p": s.prompt, "c": s.completion, "lp": s.logprobs.float().numpy().tobytes(), "a": s.advantage,
            "st": s.staleness, "g": s.group, "r": s.replay, "co": s.collect}


def _decode_seq(d: dict) -> Seq:
    lp = torch.from_numpy(np.frombuffer(d["lp"], dtype=np.float32).copy())
    return Seq(d["p"], d["c"], lp, d["a"], d["st"], d["g"], d["r"], d["co"])
