"""The one typed configuration schema for every process (loading and writing it: config_io.py).

A run's config is TOML (or the embedded CPU-demo default) plus dotted command-line overrides such as
`learner.lr=5e-5`. Every model forbids unknown keys, so a typo is an error naming the key, not a
silently ignored setting. The resolved config is written to the run folder as JSON, and actors started
elsewhere receive the learner's resolved config over the wire, so both sides always agree.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _none_words(cls, value: Any, info: ValidationInfo) -> Any:
        """TOML has no null: "none"/"null" (any case) set an optional field to None, in files and overrides."""
        if isinstance(value, str) and value.lower() in ("none", "null"):
            ann = cls.model_fields[info.field_name].annotation
            if type(None) in getattr(ann, "__args__", ()):
                return None
        return value


class ModelConfig(_Strict):
    path: str = "toy"
    """Hugging Face model folder (local path or hub id), or "toy" for the built-in tiny policy the CPU
    demo builds and caches (see `toy`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype of the actors (vLLM), of the weights they are sent and of the exported final model.
    The learner always keeps fp32 master weights and optimizer state (`learner.mixed_precision` sets
    its compute dtype). "auto": bfloat16 where this machine computes bf16 fast (a GPU with bf16; a CPU
    with native bf16 that a short probe finds faster), else float32, chosen with
    `learner.mixed_precision="auto"` at launch and recorded in config.json (exgrpo_async/precision.py)."""
    max_model_len: int = Field(256, gt=0)
    """Longest prompt + response, in tokens, that vLLM must support."""


class ToyConfig(_Strict):
    cache_dir: str = "~/.cache/exgrpo_async"
    """Folder where the warm-started tiny policy and the toy train/test files are cached."""
    seed: int = 0
    """Seed for the toy task's held-out set, training pool and SFT."""
    sft_steps: int = Field(600, gt=0)
    """Optimizer steps of the supervised warm start (only run when the cache has no policy); a step
    count, not a time budget, so a busy machine builds the same policy, only later. Seed 0 and 600
    steps are shipped (exgrpo_async/toy/shipped.py: installed in a second, held-out greedy 0.56); any
    other recipe is trained here (600 steps: about 70 s on a 2-core Xeon with AMX, 250 s on an
    AVX2-only EPYC)."""
    sft_threads: int = Field(2, gt=0)
    """torch threads for the warm start."""

    @model_validator(mode="before")
    @classmethod
    def _sft_seconds_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sft_seconds" in data:
            raise ValueError("toy.sft_seconds was replaced by toy.sft_steps (a fixed number of SFT optimizer "
                             "steps, so the warm start no longer depends on machine load; the default 600 takes "
                             "about 170 s on an idle 2-core machine)")
        return data


class DataConfig(_Strict):
    train_files: list[str] = []
    """Training question files (JSONL, JSON array or parquet). Empty with model.path="toy": the toy pool."""
    eval_file: str | None = None
    """Held-out file scored before and after training (and every `eval_every` steps). Unset with the
    toy model: the toy test set; set to none: no held-out evaluation."""
    prompt_template: str = "{problem}"
    """Python format string applied to the question text; `{problem}` is replaced."""
    system_prompt: str | None = None
    """System message placed before the question when `use_chat_template` is true."""
    use_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (rows in verl format always carry messages)."""
    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's (for training, evaluation and the exported
    models), or "think": the ExGRPO authors' template, "{system} User: This is the problem: {question}
    Assistant: <think>" + newline, for a backbone whose own template does not open the think block
    (Qwen2.5-Math-1.5B; their 7B model ships it). None: the tokenizer's own."""
    max_prompt_tokens: int = Field(1024, gt=0)
    """Questions whose prompt is longer than this are skipped and counted, as the authors do; so are those
    longer than model.max_model_len less rollout.max_new_tokens, when that is less (training questions
    skipped, held-out ones left out of the evaluations; summary.json `prompts_too_long`)."""
    skip_bad_rows: bool = False
    """A malformed data row is an error naming file and row; true skips such rows instead (each one
    logged and counted). MATH train (deepscaler_rllm/train/math.json) has 4 rows without an answer."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of the training questions."""


class RolloutConfig(_Strict):
    samples_per_question: int = Field(8, ge=2)
    """K: completions sampled per question; the group that shares one baseline."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for training rollouts (top-p 1, top-k off)."""
    max_new_tokens: int = Field(64, gt=0)
    """Longest completion. Also the constant L_max in the Dr.GRPO loss normalizer."""
    questions_per_request: int = Field(16, gt=0)
    """How many questions an actor takes from the learner in one work request (one vLLM call: a larger
    call batches more sequences per decode step; on the toy task 16 generated a step 22% faster than 8)."""
    eval_temperature: float = Field(1.0, ge=0)
    """Temperature of held-out evaluation samples (0 = greedy)."""
    seeded: bool = False
    """Seed every vLLM request from (learner.seed, question, policy version at dispatch), so rollouts no
    longer depend on which actor drew them or on an actor's RNG history: with max_staleness=0 a run
    resumed from a checkpoint repeats the uninterrupted one."""
    eval_samples: int = Field(2, gt=0)
    """Samples per held-out question; accuracy is their mean (avg@n). The demo's 2 over its 1,000 toy
    questions: for a gain measured on one set of questions, more questions narrow its error more than
    more samples of each (docs/benchmarks.md, "The demo on two classes of CPU")."""


class VerifierConfig(_Strict):
    workers: int = Field(1, gt=0)
    """math-verify worker processes per actor (spawn-based pool)."""
    timeout_s: float = Field(15.0, gt=0)
    """Hard deadline of one verification; the worker is killed and replaced, the rollout scores 0."""
    require_think: bool = False
    """ExGRPO's reward: the answer is read only after "</think>" (prepending "<think>\\n"); a response
    without it scores 0. Off for the toy task, on for the think-template recipes."""
    memory_limit_mb: int = Field(4096, gt=0)
    """Address-space cap of each verifier worker (RLIMIT_AS); huge-number inputs fail, not the host."""
    function: str | None = None
    """Your own reward instead of math-verify: "package.module:function", called as
    function(response, gold, row) -> float in [0, 1] in the same worker pool (deadline, memory cap),
    with `response` the answer region (see `require_think`) and `row` the question's question_id,
    data_source, answer, prompt and purpose. Imported by the launcher at `train` start and by every
    actor before any work, so a typo fails at once; a raise or a value outside [0, 1] scores 0
    (status error, counted, logged in aggregate). Example: "exgrpo_async.rewards:exact_match".
    None: math-verify (docs/architecture.md, "Bring your own verifier")."""

    @field_validator("function")
    @classmethod
    def _function_spec(cls, value: str | None) -> str | None:
        from exgrpo_async.custom_reward import check_spec  # the form only; importing is the actors' job

        return None if value is None else check_spec(value)


class EngineConfig(_Strict):
    kind: Literal["batch", "stream"] = "batch"
    """"batch": vLLM's LLM; the actor generates, verifies and sends one batch of work at a time and takes
    new weights between batches (every group is generated by one version). "stream": vLLM's AsyncLLM;
    up to `max_inflight_groups` groups generate continuously while finished ones are verified and sent,
    and new weights arrive in flight (see `inflight_update`)."""
    inflight_update: Literal["wait", "abort"] = "wait"
    """Stream engine only: what happens to groups generating when new weights arrive. "wait": the
    broadcast is received while they run, they finish on the old weights and keep their version tag,
    then the engine pauses to load. "abort": the engine pauses at once, cut groups are resubmitted on
    the new weights (tagged with the new version; their partial tokens are wasted)."""
    max_inflight_groups: int = Field(16, gt=0)
    """Stream engine only: groups (questions x n samples) generating at once per actor."""
    kv_cache_mb: int = Field(64, gt=0)
    """KV-cache size per CPU engine, MiB (ignored on GPU, where gpu_memory_utilization rules)."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (GPU only)."""
    tensor_parallel_size: int = Field(1, gt=0)
    """vLLM tensor parallelism per actor: its workers split each layer, and all of them join the
    actor's weight-sync group. On CPU each worker is a process bound to its own share of the actor's
    cores (VLLM_CPU_OMP_THREADS_BIND), so it needs at least that many cores and `in_process = false`."""
    enforce_eager: bool = True
    """Skip CUDA graphs / compilation. Must stay true on CPU; false is faster on GPU."""
    in_process: bool = True
    """Run vLLM's engine core inside the actor process (VLLM_ENABLE_V1_MULTIPROCESSING=0): 2 s start and
    half the memory on CPU. Weight sync works the same either way."""
    max_num_seqs: int = Field(256, gt=0)
    """vLLM's cap on concurrently scheduled sequences."""
    cpu_weight_reload: Literal["prepacked", "layerwise"] = "prepacked"
    """CPU only: how new weights enter vLLM's oneDNN-packed layers. "prepacked": new packed layers are
    built while the broadcast arrives (and, for in-flight updates, while generation goes on), then
    swapped in; holds a second set of packed weights while a sync is staged. "layerwise": vLLM's
    layerwise reload after the broadcast (less memory, slower; for in-flight updates the whole reload
    runs with generation stopped). A model the swap cannot handle falls back to layerwise with a
    warning; a tensor-parallel engine always uses layerwise."""


class ActorConfig(_Strict):
    max_restarts: int = Field(3, ge=0)
    """`exgrpo-async train` restarts a local actor that exits with an error up to this many times."""
    fault_corrupt_load_at_syncs: list[int] = []
    """Fault drill: after these weight loads (counted from 1 in each actor process) one weight of the
    engine is changed, as a loader that skipped a tensor leaves it. The fingerprint check
    (weight_sync.fingerprint) must catch each one. Leave empty."""
    num_actors: int | None = Field(None, ge=0)
    """Actor processes that `exgrpo-async train` starts locally (more may join with `exgrpo-async actor`).
    None: chosen from the machine (exgrpo_async/layout.py): on CPU an actor per core (a core per vLLM
    worker), `nice` below the learner; on GPU every GPU the learner does not take."""
    threads: int = Field(1, gt=0)
    """torch/OpenMP threads per actor on CPU; actors are pinned, a core per vLLM worker, when cores allow."""
    pin_cores: bool = True
    """`exgrpo-async train` pins each local actor to its own core and the learner to the cores left over
    (when there are more cores than actors); false leaves placement to the OS scheduler."""
    nice: int = Field(10, ge=0, le=19)
    """CPU runs: `exgrpo-async train` starts local actors this much nicer (lower priority) than the
    learner. The learner's step is the critical path; with actors on every core, the scheduler then
    gives the learner a core whenever it trains and the actors every cycle it leaves (cores lent from
    the idle side to the busy one as the run goes). 0: equal priority. Not applied on GPU nodes."""
    engine: EngineConfig = EngineConfig()
    """The vLLM engine of each actor."""
    verifier: VerifierConfig = VerifierConfig()
    """Reward computation."""


class PlacementConfig(_Strict):
    gpus: int | None = Field(None, ge=0)
    """GPUs of this node that `exgrpo-async train` places processes on (None: every visible CUDA device;
    0: a CPU run, no placement). exgrpo_async/launcher/placement.py."""
    learner_gpus: list[int] | None = None
    """The learner ranks' GPUs, one per rank (None: the first `learner.world_size` GPUs)."""
    actor_gpus: list[list[int]] | None = None
    """Each local actor's GPUs, `actor.engine.tensor_parallel_size` each (None: the GPUs after the
    learner's, in order)."""
    rehearse: bool = False
    """A CPU rehearsal of this GPU plan (`train --rehearse`, exgrpo_async/launcher/rehearse.py): each process gets
    the CUDA_VISIBLE_DEVICES the plan gives it on the node, but trains and generates on CPU, so the
    node's CUDA devices are not counted."""


class LearnerConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner trains; "auto" picks cuda when available. Also picks the weight-sync backend."""
    threads: int | None = Field(None, gt=0)
    """torch threads of the learner on CPU, per learner rank. None: half the cores, shared by the ranks
    (exgrpo_async/layout.py); outside `train`, the process's cores / local ranks."""
    world_size: int = Field(1, gt=0)
    """Learner ranks training one step together, the model sharded over them with FSDP2 (one per GPU;
    gloo processes on CPU). `train` starts them on this machine; under `torchrun` (`exgrpo-async
    learner`, any number of nodes) it must equal torchrun's WORLD_SIZE. Rank 0 keeps the server,
    dispatcher and experience buffer; the batch is split over the ranks by tokens."""
    rank_timeout_s: float = Field(3600.0, gt=0)
    """How long a learner rank waits in any collective (NCCL's watchdog, gloo's timeout). A follower
    waits for rank 0's next operation outside any collective (learner/ranks.py), so rank 0's own work
    between two operations (an evaluation, a checkpoint) is not bounded by this."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' gradient checkpointing, non-reentrant): activation memory per layer boundary only."""
    mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    """Compute dtype of the learner's forward passes: "bf16" runs them under bf16 autocast while the
    master weights, gradients and AdamW state stay fp32 (the authors' set-up); "none" computes in fp32.
    Log-probs and entropies are always reduced in fp32. "auto": "bf16" where this machine computes bf16
    fast, else "none", decided with `model.dtype="auto"` (exgrpo_async/precision.py)."""
    attention: Literal["auto", "sdpa", "varlen", "per_sequence"] = "auto"
    """How the learner's decoder keeps each sequence of a packed row to itself (learner/maths/attention.py).
    "sdpa": transformers' block-diagonal mask over the whole row (every pair of a W-wide row computed);
    "varlen": PyTorch's variable-length flash attention, causal within each sequence (CUDA, bf16);
    "per_sequence": one causal SDPA call per sequence (any device and dtype). "auto": "varlen" on a
    CUDA learner computing in bf16, else "sdpa". A start-up check proves the choice keeps sequences apart."""
    compile: Literal["auto", "on", "head", "off"] = "auto"
    """Compile the learner's model in regions with `torch.compile` (learner/maths/compiled.py): each decoder
    layer's body, and the output head's log-prob and entropy, fusing the
    memory-bound work between the matrix multiplies (the 1.5B step on an H200: 1.67 s with both compiled
    and no checkpointing, 2.61 s with the head alone compiled and checkpointing, 3.01 s eager with checkpointing;
    docs/benchmarks.md, "Host synchronisations"). The first steps pay the compile (tens of seconds on a
    GPU). Compiled layers take "varlen" attention into their graph (1.6725 s against 1.7094 s with the graph
    broken at the attention, median of three H200 runs). With `gradient_checkpointing` a layer is compiled
    whole with its checkpoint inside its graph (selective: the attention's output kept), which needs attention
    "varlen" or "per_sequence". "on":
    both regions; "head": the head alone; "auto": on a CUDA learner the head, and the layers too (under
    checkpointing with a traceable attention backend only); nothing on CPU."""
    questions_per_step: int = Field(32, gt=0)
    """B: questions (groups of K) per learner step."""
    max_steps: int = Field(150, gt=0)
    """Learner steps (policy versions) to train. The demo's 150 keep its whole run, set-up included,
    inside 10 minutes on an AVX2-only 2-core CPU (docs/benchmarks.md, "The demo on two classes of CPU")."""
    minibatches_per_step: int = Field(1, gt=0)
    """Optimizer updates per learner step (the paper: 2, i.e. mini-batches of B/2 questions)."""
    micro_batch_sequences: int = Field(64, gt=0)
    """Sequences per forward/backward; gradients are accumulated over micro-batches. Unused when
    `max_tokens_per_micro_batch` is set."""
    overlap_arrival: bool = False
    """Forward and back-propagate a micro-batch as soon as the step's groups already received fill one,
    while the actors finish the rest, instead of waiting for all B groups: the same gradient, since the
    loss scale is fixed before the first group arrives (learner/overlap.py). For a learner on devices of
    its own, idle while the batch completes; off by default: on the CPU demo, where learner and actors
    share two busy cores, it made the run slower (docs/benchmarks.md, "Micro-batches while the batch
    arrives"). Applies with one learner rank and one mini-batch per step; other runs wait for the whole
    batch (logged at start)."""
    max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    """Token budget of one forward/backward (prompt + completion tokens): sequences are packed back to
    back into rows of at most this many tokens, without padding (position ids restart per sequence),
    and a micro-batch takes as many as fit; memory then follows the budget, not the lengths. None: one
    padded row per sequence, `micro_batch_sequences` at a time."""
    lr: float = Field(5e-5, gt=0)
    """AdamW learning rate (constant after warm-up)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer updates."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global grad-norm clip."""
    skip_grad_norm: float = Field(500.0, gt=0)
    """An optimizer update is skipped (and counted) when the grad norm is non-finite or above this."""
    clip_eps: float = Field(0.2, ge=0)
    """PPO clip epsilon on the ratio pi_theta/pi_prox (pi_theta/pi_behav when `off_policy_correction`
    is "none")."""
    off_policy_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                   "sequence_mask"] = "token_truncate"
    """Staleness-aware correction (decoupled PPO). Not "none": the learner takes pi_prox = its own
    log-probs before the step's update (mini-batch 0 reads them from its forward pass, later mini-batches
    from a no-grad recompute), clips pi_theta/pi_prox, and weights each fresh token by
    w = pi_prox/pi_behav: truncated to min(w, C) or masked to 0 beyond C, per token or per sequence
    (product of the token ratios). "none": plain PPO against the behaviour log-probs (the baseline)."""
    off_policy_cap: float = Field(2.0, gt=0)
    """C, the truncation or mask threshold of the importance weight pi_prox/pi_behav."""
    drop_zero_advantage: bool = True
    """Skip sequences whose advantage is 0 in the forward/backward: the gradient is unchanged (with
    `entropy_coef` > 0 they stay, because they add to the entropy bonus)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus, on the policy-gradient term's own scale: loss -= coef * sum of token entropies /
    (sequences x L_max), the same denominator as the Dr.GRPO term, so `coef` is the weight of one token's
    entropy relative to one token's policy gradient per unit advantage, whatever the micro-batching.
    The authors' 0.001 token-mean bonus is about 3e-4 on this scale (docs/exgrpo.md, "Loss scale")."""
    clip_schedule: Literal["always", "until_start"] = "until_start"
    """When the PPO clip (`clip_eps`) applies to fresh tokens: "always", or "until_start": until the
    delayed-start switch fires (batch pass@1 above `exgrpo.start_threshold`; at step 1 with
    `exgrpo.delayed_start=false`), as the authors do. The switch is tracked with ExGRPO off too, so an
    on-policy baseline can share the schedule."""
    max_generated_tokens: int | None = Field(None, gt=0)
    """Stop after the step at which this many fresh completion tokens have been generated for training
    (replayed trajectories not counted); None: only `max_steps` ends training. For comparisons at equal
    work (ops/bench/learning/learning.py)."""
    max_seconds: float | None = Field(None, gt=0)
    """Stop after the step that ends this many seconds into this process's training (timed from the end
    of the evaluation before training), then finish as at `max_steps`: final evaluation, model,
    summary. None: no time budget. For runs on a wall-clock budget (ops/bench/system/soak.py)."""
    eval_every_tokens: int = Field(0, ge=0)
    """Also evaluate on the held-out file each time another N fresh completion tokens have been generated
    (0: off); the row records `tokens_generated_total`, so arms compare at equal generated tokens."""
    max_staleness: int = Field(2, ge=0)
    """eta: work is handed out for at most this many steps beyond the one being filled, and rollouts
    more than this many versions behind the learner are not trained on; their questions are re-queued
    (counted as `stale_dropped`). 2 by default: with 1, the demo's actors run out of admitted work
    during part of each learner step and the learner idles over 15%; with 2 both sides stayed under it
    in a 3-seed comparison (not in every later run), at the same speed and accuracy within the seeds'
    spread (docs/benchmarks.md, "eta 2"). The 8-GPU configs set 1."""
    wait_for_expiring: bool = True
    """Fill each step with the groups that could not be trained after it first, and hold back groups
    that could, while such groups are still being generated (at most the previous step's time). Off:
    groups are trained in arrival order, so with several actors a slower actor's groups can arrive
    one step too late and be dropped and generated again (docs/benchmarks.md, "Stale drops")."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the held-out file every N steps (0: only before and after training)."""
    eval_before: bool = True
    """Evaluate the starting weights on the held-out file before the first step (verl's
    `val_before_train`); false skips it (summary.json's `before` is then null; a resumed run never
    repeats it)."""
    best_exclude_sources: list[str] = ["minerva"]
    """Held-out data sources left out of the score that picks the best weights: the mean over the other
    sources of each source's sampled accuracy (the authors leave Minerva out). Each evaluation during
    training that beats the best so far exports its weights to RUN_DIR/best (with best.json)."""
    seed: int = 0
    """Learner seed (question order, torch)."""
    fault_nan_loss_at_steps: list[int] = []
    """Fault drill: the loss of these learner steps is made NaN. The non-finite grad norm must be caught
    (the update skipped and counted in skipped_steps) and training must go on. Leave empty."""
    checkpoint_every: int = Field(50, ge=0)
    """Save a resumable checkpoint (model, optimizer, experience buffer, data position, RNGs, queues) to
    RUN_DIR/checkpoints every N learner steps; one is also saved at the end of training. 0: only at the end."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints are kept; older ones are deleted once a new one is complete."""


class ExGRPOConfig(_Strict):
    enabled: bool = False
    """Turn on ExGRPO experience replay; false trains plain on-policy Dr.GRPO."""
    rho: float = Field(0.5, ge=0, le=1)
    """Share of each step's B questions that may be experience questions (floor(rho*B))."""
    delayed_start: bool = True
    """Collect and replay only after a step whose batch pass@1 exceeds `start_threshold` (one-way).
    False: active from step 1 (the paper's Llama setting)."""
    start_threshold: float = Field(0.35, ge=0, le=1)
    """Batch pass@1 that switches on collection and replay."""
    question_weighting: Literal["gaussian", "gaussian_per_question", "uniform"] = "gaussian"
    """Question sampler: "gaussian" weights each bucket k by the Gaussian (the authors'; a bucket's share
    does not depend on its size), "gaussian_per_question" weights each question by its bucket's Gaussian
    (a bucket's share grows with its size: a handful of medium questions cannot take most of the draws),
    "uniform" samples questions uniformly (the "w/o question selection" ablation)."""
    sigma: float = Field(1.0, gt=0)
    """Gaussian sigma, in the units of `units`."""
    mu: float | None = None
    """Gaussian mean; None = K/2 in count units, 0.5 in accuracy units."""
    units: Literal["count", "accuracy"] = "count"
    """"count": N(k; K/2, 1), the authors' code (default). "accuracy": N(k/K; 0.5, 1), the paper's text."""
    selection: Literal["lowest_entropy", "highest_entropy", "random"] = "lowest_entropy"
    """Which stored trajectory of a chosen question is replayed (ablations: random, highest)."""
    selection_metric: Literal["entropy", "nll"] = "entropy"
    """Mean token entropy under the current policy (paper text) or mean negative log-likelihood."""
    shaping_beta: float | None = 0.1
    """Policy shaping f(w) = w/(w+beta) on replayed tokens; "none" = f(w) = w (the "w/o shaping" ablation)."""
    importance_correction: bool = True
    """w = pi_theta/pi_past on replayed tokens; false replaces pi_past by the current recompute (ablation)."""
    pi_past: Literal["learner", "behaviour"] = "learner"
    """Stored per-token log-probs: the learner's recompute at the step the trajectory was trained
    (the authors'), or vLLM's sampling log-probs."""
    retire: bool = True
    """Retire questions solved K/K (out of replay at once, out of the fresh pool at the next epoch)."""
    max_trajectories: int | None = None
    """Cap on stored trajectories (FIFO eviction); None never evicts (the authors')."""
    reinject_every: int = Field(0, ge=0)
    """Paper ablation (Table 7): every N steps put a share `reinject_frac` of the retired questions back
    (un-retired: collectable and replayable again, and back in the fresh pool from the next epoch). 0: off."""
    reinject_frac: float = Field(0.1, gt=0, le=1)
    """Share of the retired questions put back each `reinject_every` steps."""
    discard_displaced: bool = True
    """The authors' collate: each experience question queued displaces one fresh draw, which is
    discarded (the question sampler moves past it), so an epoch of the training pool lasts as many
    steps as on-policy GRPO's and retirement prunes the same later epochs. False keeps the displaced
    draws for later steps, so ExGRPO's epochs last about 1/(1 - rho) times longer (the ablation)."""
    selection_batch_sequences: int = Field(64, gt=0)
    """Sequences per no-grad forward when scoring stored trajectories."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "entropy_coef" in data:
                raise ValueError("exgrpo.entropy_coef moved to learner.entropy_coef, now on the policy-gradient "
                                 "term's token-sum scale (the authors' 0.001 token mean is about 3e-4 there)")
            if "clip_after_switch" in data:
                raise ValueError("exgrpo.clip_after_switch was replaced by learner.clip_schedule "
                                 "(\"always\" keeps the clip after the switch, \"until_start\" removes it)")
        return data


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback IP addresses (127.0.0.0/8, ::1); false for names and 0.0.0.0."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TransportConfig(_Strict):
    host: str = "127.0.0.1"
    """Address the learner binds for actors (ZeroMQ, and the weight-sync TCPStore). 127.0.0.1 unless
    actors run on other hosts; any other address needs `curve_keys_dir` (or `allow_insecure_remote`)."""
    curve_keys_dir: str | None = None
    """Key folder made by ops/make-keys. Set: the learner's socket uses CurveZMQ (encrypted, and only
    actors whose public key is in its authorized_clients/ can connect; actors need `--keys`). Required
    when `host` is not a loopback address."""
    allow_insecure_remote: bool = False
    """Allow a non-loopback `host` without `curve_keys_dir`: then anyone who reaches the port can take
    work and inject rollouts. Only for a network you fully trust."""
    port: int = Field(0, ge=0, lt=65536)
    """Learner's ZeroMQ port; 0 picks a free one (printed, and passed to local actors)."""
    max_message_mb: int = Field(256, gt=0)
    """Largest accepted message; bigger ones are refused by ZeroMQ and never decoded."""
    work_deadline_s: float = Field(600.0, gt=0)
    """Work not returned within this many seconds is re-issued to another actor (its actor died or
    froze); late rollouts of re-issued work are dropped and counted, never trained twice."""
    request_timeout_s: float = Field(120.0, gt=0)
    """How long an actor waits for the learner to answer a request before it counts it as lost."""
    actor_timeout_s: float = Field(30.0, gt=0)
    """An actor not heard from for this long (neither requests nor its heartbeat, sent every
    `heartbeat_s`) is presumed dead: its work is re-issued at once and its weight-sync group closed."""
    join_timeout_s: float = Field(600.0, gt=0)
    """An actor that has said hello but not yet asked for its weight-sync group (its engine is starting)
    holds no work, and is presumed dead only when unheard for this long; `actor_timeout_s` applies from
    its group on. Starting an engine can keep its heartbeat thread from running: a model load or a
    compile on a busy CPU (a low-priority actor beside the learner), CUDA graph capture on a GPU."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Interval of the actor's heartbeat, sent from its own thread and socket so a long generation
    never looks like a dead actor."""
    reconnect_s: float = Field(300.0, ge=0)
    """After losing the learner, an actor keeps saying hello (to a restarted learner on the same
    address) this long before it exits; its engine stays loaded meanwhile. 0: exit at once."""
    max_pending_joins: int = Field(64, ge=1)
    """Actors that may be part-way through joining at once: said hello, weight-sync group not formed yet
    (an engine starting, a rendezvous under way, or a peer stalled there until `weight_sync.timeout_s`).
    A hello beyond this is answered "wait" and counted (`joins_refused`); the actor asks again. Bounds
    the learner's half-joined peers, their threads and pending groups; raise it to start more actors
    at once."""

    @model_validator(mode="after")
    def _remote_needs_keys(self) -> "TransportConfig":
        if not is_loopback(self.host) and self.curve_keys_dir is None and not self.allow_insecure_remote:
            raise ValueError(
                f"transport.host={self.host!r} is not a loopback address: set transport.curve_keys_dir to a key "
                "folder made by ops/make-keys (encryption and actor authentication), or "
                "transport.allow_insecure_remote=true on a network you fully trust")
        return self


class WeightSyncConfig(_Strict):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: gloo on CPU, NCCL on GPU ("auto" follows the learner device)."""
    port: int = Field(0, ge=0, lt=65536)
    """TCPStore port of the weight-sync groups; 0 picks a free one."""
    timeout_s: float = Field(300.0, gt=0)
    """Deadline of one group set-up or broadcast."""
    bucket_mb: int = Field(64, gt=0)
    """Weights travel in buckets of about this size; receive of bucket i+1 overlaps the load of bucket i."""
    publish_sets: int | None = Field(None, ge=1)
    """Packed copies of the weights the lead learner rank keeps for sending (each the model's size in
    `model.dtype`: 15 GB at 7B in bf16, on its GPU): when sends hold them all, the next publish waits
    for one (a send ends within `timeout_s`) instead of allocating another. Unset: 1 on a GPU (the lead
    would not fit two beside a 7B rank's state: docs/memory.md), unbounded on CPU (never wait)."""
    fingerprint: bool = True
    """After each load an actor fingerprints the weights its engine computes with (exact bit sums of
    each linear layer's output for a few one-hot inputs and of the other parameters, per block:
    exgrpo_async/fingerprint.py) and reports it; the learner compares it with the published version's,
    counts a mismatch (`weight_fingerprint_mismatches`, alert ExgrpoWeightFingerprintMismatch), re-sends
    the weights and trains on nothing that actor generated with them. Costs a read of the embeddings and
    a few columns of every matrix per load. A tensor-parallel engine's workers each fingerprint their
    share and the actor adds them up (actors/fingerprint.py); an engine with key/value heads copied onto
    several workers reports none. Turn off only for a model whose loader transforms weights (every sync
    would mismatch)."""


class MetricsConfig(_Strict):
    host: str = "127.0.0.1"
    """Address of the learner's Prometheus endpoint (/metrics)."""
    port: int | None = Field(0, ge=0, lt=65536)
    """Port of the learner's Prometheus endpoint; 0 picks a free one (written to RUN_DIR/learner.json),
    None turns the endpoint off."""
    actor_host: str = "127.0.0.1"
    """Address each actor's Prometheus endpoint binds; 0.0.0.0 when Prometheus scrapes actors on other
    hosts. Every actor receives this from the learner's config, so a wildcard endpoint is listed under
    each host's own address: `--advertise-host` / $EXGRPO_ADVERTISE_HOST (ops/slurm/node.sh sets it),
    else the host's FQDN."""
    actor_port: int | None = Field(0, ge=0, lt=65536)
    """Port of each actor's Prometheus endpoint; 0 picks a free one (actors report it to the learner,
    which lists it in the service-discovery file), None turns actor endpoints off. A fixed port only
    suits one actor per host."""
    sd_dir: str | None = None
    """Folder for a Prometheus file-SD file `<run>.json` (ops/prometheus/prometheus.yml reads
    ops/prometheus/targets/); it is removed when the run ends or is stopped (a crashed learner leaves it,
    so its targets show as down). The learner always writes RUN_DIR/prometheus-targets.json as well."""
    stall_warning_s: float = Field(300.0, gt=0)
    """The learner logs a warning when no step has ended for this long (ExgrpoLearnerStalled)."""
    buffer_empty_warning_steps: int = Field(20, ge=1)
    """The learner logs a warning when the experience buffer has been empty this many steps after the
    delayed start (ExgrpoBufferEmpty)."""
    verifier_timeout_warning_frac: float = Field(0.05, ge=0, le=1)
    """An actor logs a warning when more than this share of one verification batch times out
    (ExgrpoVerifierTimeouts)."""
    trackers: list[Literal["wandb", "tensorboard"]] = []
    """Experiment trackers fed from the same per-step row as metrics.jsonl, with the run's config and its
    held-out evaluations: "wandb" (Weights & Biases, a run named after the run folder) and/or
    "tensorboard" (event files in RUN_DIR/tensorboard). Each needs its extra: pip install
    'exgrpo-async[wandb]' or '[tensorboard]'."""
    wandb_project: str = "exgrpo-async"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the logged-in user's default."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; "offline" writes RUN_DIR/wandb for a later `wandb sync`. None: W&B's own default
    (WANDB_MODE, else online)."""

    @field_validator("trackers")
    @classmethod
    def _unique_trackers(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"a tracker is named twice: {v}")
        return v


class RunConfig(_Strict):
    output_dir: str = "runs/demo"
    """Parent of run folders: each run gets a new run-YYYYmmdd-HHMMSS folder here holding the resolved
    config, metrics.jsonl, summary.json and the final Hugging Face model."""
    model: ModelConfig = ModelConfig()
    """The policy."""
    toy: ToyConfig = ToyConfig()
    """The built-in toy task (used when model.path == "toy")."""
    data: DataConfig = DataConfig()
    """Questions."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    actor: ActorConfig = ActorConfig()
    """Actor processes."""
    learner: LearnerConfig = LearnerConfig()
    """The learner process and the GRPO update."""
    exgrpo: ExGRPOConfig = ExGRPOConfig()
    """Experience replay (ExGRPO)."""
    transport: TransportConfig = TransportConfig()
    """Rollout and work transport (ZeroMQ)."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Weight broadcast (torch.distributed)."""
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus export."""
    placement: PlacementConfig = PlacementConfig()
    """Which GPUs `exgrpo-async train` gives the learner ranks and each actor on this node."""

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.model.path != "toy" and not self.data.train_files:
            raise ValueError("data.train_files is empty: give at least one training file (or use model.path='toy')")
        if self.rollout.max_new_tokens >= self.model.max_model_len:
            raise ValueError(f"rollout.max_new_tokens={self.rollout.max_new_tokens} leaves no room for a prompt in "
                             f"model.max_model_len={self.model.max_model_len} (prompt and completion together)")
        if self.learner.questions_per_step % self.learner.minibatches_per_step:
            raise ValueError("learner.questions_per_step must be divisible by learner.minibatches_per_step")
        L = self.learner
        if L.compile == "on" and L.gradient_checkpointing and L.attention == "sdpa":
            raise ValueError("learner.compile='on' with learner.gradient_checkpointing=true needs learner.attention "
                             "'per_sequence', 'varlen' or 'auto' (a checkpointed layer is compiled whole, and the "
                             "'sdpa' path builds its packed mask on the host: learner/maths/compiled.py)")
        return self
