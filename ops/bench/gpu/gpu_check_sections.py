"""The sections of ops/bench/gpu/gpu_check.py, one function each: `section(ctx) -> dict` of figures.

Each builds what it needs (random-weight models from learner/maths/memory_model.py's shapes; no hub) and
leaves nothing behind but what `Context.keep` holds for a later section. `ctx.tiny` swaps in toy
shapes, so the CPU rehearsal (tests/unit/test_gpu_check.py) runs every line that does not need CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import gpu_gaps
import torch
from gpu_kernels import kernels  # noqa: F401  (section 5, "kernels": its own file)

from learner.maths.memory_model import QWEN25_7B, QWEN25_15B, Shape, qwen2_config, rank_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
from bench import REPO  # noqa: E402

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}
TINY_15B = Shape("tiny (1.5B stand-in)", 64, 160, 2, 4, 2, 512, True)
TINY_7B = Shape("tiny (7B stand-in)", 96, 192, 3, 4, 2, 640, False)


# variants run only when `--variants` names them (docs/history/benchmarks-notebook.md has the figures of those
# measured): FSDP2 with the layers
# compiled and no checkpointing (the 7B config checkpoints), the head at the CPU's 512-position chunk, the
# step eager without checkpointing (87 GB: no config), the head alone compiled, and the GPU's variants that
# no config runs now (the CPU rehearsal runs its own, per_sequence ones, all of them)
ON_REQUEST = ("fsdp2_varlen_fused_compiled_no_ckpt", "fsdp2_per_sequence_fused_compiled_no_ckpt",
              "checkpointing_chunk_512", "no_checkpointing_chunk_auto", "compiled_head_checkpointing",
              # measured on an H200 (sdpa and foreach AdamW in issue 34's first lease; autocast's casts
              # instead of working weights and the head alone compiled in issue 51's), so the check keeps
              # within 8 minutes
              "unsharded_sdpa_foreach", "unsharded_varlen_foreach", "unsharded_varlen_fused",
              "unsharded_varlen_fused_compiled_no_ckpt", "unsharded_varlen_fused_compiled_head_ww",
              "fsdp2_varlen_fused_compiled_head",
              # the layers compiled whole without checkpointing with per_sequence attention (its traceable
              # variant attends over whole rows; no config runs it: learner/maths/compiled.py `attention_in_graph`)
              "unsharded_per_sequence_fused_compiled_whole")


class Context:
    def __init__(self, device: str, tiny: bool, steps: int, variants: list[str] | None = None):
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.tiny, self.steps, self.variants = tiny, steps, variants
        self.keep: dict = {}
        self.out = None  # gpu_check.py: the output folder (the profile's traces go there)
        self.on_partial = None  # gpu_check.py: writes a section's figures so far
        if self.cuda:
            torch.cuda.set_device(self.device)

    def dist(self) -> None:
        """The default process group of one rank (FSDP2 needs one): NCCL on a GPU, gloo on CPU."""
        import os

        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + random.Random().randrange(500)))
            dist.init_process_group("nccl" if self.cuda else "gloo", rank=0, world_size=1)

    def wants(self, variant: str) -> bool:
        """Whether a variant of step_1.5b or profile runs: the ones `--variants` names, else all but those
        measured before that no config runs (ON_REQUEST: the check stays within 8 minutes on one GPU)."""
        return variant in self.variants if self.variants is not None else variant not in ON_REQUEST

    def partial(self, section: str, figures: dict) -> None:
        """A long section's figures so far, written out before it goes on."""
        if self.on_partial is not None:
            self.on_partial(section, figures)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> int:
        if not self.cuda:
            return 0
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    @property
    def bf16(self) -> bool:
        return self.cuda

    @property
    def peak_flops(self) -> float | None:
        if not self.cuda:
            return None
        name = torch.cuda.get_device_name(self.device)
        return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _timed(ctx: Context, fn, repeats: int = 3) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(s: Shape, layers: int, device: torch.device, max_positions: int = 8192):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(s, layers, max_positions=max_positions))
    model.config.use_cache = False
    return model


# --------------------------------------------------------------------------------------------- 1. env
def env(ctx: Context) -> dict:
    import platform

    import transformers

    r = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__, "device": str(ctx.device)}
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        r.update(name=p.name, total_memory=p.total_memory, sms=p.multi_processor_count,
                 capability=f"{p.major}.{p.minor}", nccl=".".join(map(str, torch.cuda.nccl.version())),
                 flash_sdp=torch.backends.cuda.is_flash_attention_available(),
                 device_count=torch.cuda.device_count())
    try:
        from torch.nn.attention.varlen import varlen_attn
        r["varlen_attn"] = str(inspect.signature(varlen_attn))
    except ImportError as e:
        r["varlen_attn"] = f"missing: {e}"
    import torch._inductor.config as inductor

    r["inductor"] = {"coordinate_descent_tuning": inductor.coordinate_descent_tuning,
                     "max_autotune": inductor.max_autotune}
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        r["flex_attention"] = True
    except ImportError:
        r["flex_attention"] = False
    for mod in ("pydantic", "zmq", "msgpack", "psutil", "numpy", "prometheus_client", "math_verify", "vllm",
                "flash_attn"):
        try:
            m = importlib.import_module(mod)
            r[f"pkg_{mod}"] = getattr(m, "__version__", "present")
        except Exception as e:  # absent (or broken): what this machine lacks
            r[f"pkg_{mod}"] = f"absent ({type(e).__name__})"
    return r


# ----------------------------------------------------------------------------------------- 2. imports
IMPORTS = ["exgrpo_async.config", "exgrpo_async.launcher.placement", "exgrpo_async.layout", "exgrpo_async.weight_sync",
           "exgrpo_async.fingerprint", "learner.maths.attention", "learner.policy", "learner.maths.batch",
           "learner.maths.result", "learner.maths.update", "learner.maths.memory_model", "learner.shell", "learner.main"]


def imports(ctx: Context) -> dict:
    from exgrpo_async.startup import without_gc

    r = {}
    with without_gc():  # transformers' import among them, frozen (exgrpo_async/startup.py)
        for mod in IMPORTS:
            try:
                importlib.import_module(mod)
                r[mod] = "ok"
            except Exception as e:  # recorded: which module of the closure this machine cannot import
                r[mod] = f"{type(e).__name__}: {e}"
    r["all_ok"] = all(v == "ok" for v in r.values())
    return r


# -------------------------------------------------------------------------------------------- 3. nccl
def nccl(ctx: Context) -> dict:
    """A one-rank group as the publisher builds it (make_group + warm_up), a broadcast, polling, abort."""
    import torch.distributed as dist

    from exgrpo_async.weight_sync import WeightPublisher, _broadcast, wait_all

    backend = "nccl" if ctx.cuda else "gloo"
    pub = WeightPublisher("127.0.0.1", 0, backend, ctx.device, bucket_mb=256, timeout_s=60)
    r = {"backend": backend}
    t0 = time.perf_counter()
    pub.open_group("one", 1)
    r["open_group_s"] = time.perf_counter() - t0
    n = (64 << 20) if not ctx.tiny else (1 << 16)
    t = torch.randn(n, device=ctx.device)
    for k in range(2):
        t0 = time.perf_counter()
        w = _broadcast(pub.groups["one"], t)
        polls = 0
        while not w.is_completed():
            polls += 1
            time.sleep(0.0005)
        w.wait()
        r[f"broadcast_{4 * n >> 20}MB_{k}_s"] = time.perf_counter() - t0
        r[f"broadcast_{k}_polls"] = polls
    r["send_s"] = pub.send("one", [t, t[: n // 2]])
    t0 = time.perf_counter()
    pub.close_group("one", abort=True)
    r["abort_s"] = time.perf_counter() - t0
    pub.open_group("two", 1)
    wait_all([_broadcast(pub.groups["two"], t)], 30)
    t0 = time.perf_counter()
    pub.close_group("two")
    r["shutdown_s"] = time.perf_counter() - t0
    if ctx.cuda:
        opts = dist.ProcessGroupNCCL.Options()
        r["options_attrs"] = sorted(a for a in dir(opts) if not a.startswith("__"))
        r["config_attrs"] = sorted(a for a in dir(getattr(opts, "config", None)) if not a.startswith("__")) \
            if hasattr(opts, "config") else None
    return r


# --------------------------------------------------------------------------------------- 4. attention
def _lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return out


def attention(ctx: Context) -> dict:
    """One packed row of 16k tokens at the 1.5B width (2 layers): each backend against every sequence alone."""
    from learner.maths import attention as att
    from learner.maths import grpo
    from learner.maths.grpo import rows_logprobs
    from learner.maths.packing import pack_rows

    s = TINY_15B if ctx.tiny else QWEN25_15B
    width = 512 if ctx.tiny else 16384
    model = _model(s, 2, ctx.device, max_positions=width)
    model.train()
    backends = ["sdpa", "per_sequence"] + (["varlen"] if att.varlen_available(ctx.device) else [])
    r = {"shape": s.name, "layers": 2, "row_tokens": width, "backends": backends}
    h = s.hidden
    for mix, lengths in (("4_equal", [width // 4] * 4), ("mixed", _lengths(width, width // 50, width // 4, 0))):
        g = torch.Generator().manual_seed(1)
        seqs = [torch.randint(3, s.vocab, (n,), generator=g).tolist() for n in lengths]
        prompts, comps = [q[:8] for q in seqs], [q[8:] for q in seqs]
        rows = pack_rows(prompts, comps, 0, width)
        ref = []
        att.use(model, "sdpa")
        with torch.no_grad():
            for p, c in zip(prompts, comps):  # every sequence alone: causal, no mask
                one = pack_rows([p], [c], 0, width)
                ref.append(one.split(rows_logprobs(model, one, ctx.device, 1.0, bf16=ctx.bf16).float())[0])
        sums = {"sequences": len(lengths),
                "attn_gflop_per_token_fwd_packed_full": 4 * width * h * 2 / 1e9,  # 2 layers, W^2 non-causal
                "attn_gflop_per_token_fwd_causal": sum(2 * n * n * h for n in lengths) * 2 / width / 1e9}
        for backend in backends:
            att.use(model, backend)
            with torch.no_grad():
                got = rows.split(rows_logprobs(model, rows, ctx.device, 1.0, bf16=ctx.bf16).float())
            diff = max(float((a - b).abs().max()) for a, b in zip(got, ref))

            def step():
                model.zero_grad(set_to_none=True)
                rows_logprobs(model, rows, ctx.device, 1.0, bf16=ctx.bf16).sum().backward()

            base = ctx.reset_peak()
            sec = _timed(ctx, step)
            peak = ctx.peak()
            sums[backend] = {"max_abs_dlogp_vs_alone": diff, "fwd_bwd_ms": sec * 1e3,
                             "peak_above_start_gb": (peak - base) / 1e9 if peak is not None else None}
            if ctx.cuda and mix == "mixed" and backend in ("sdpa", "varlen"):
                sums[backend]["kernels"] = _kernels(step)
        r[mix] = sums
    for backend in backends:  # the learner's start-up check on this kernel and shape
        att.use(model, backend)
        try:
            grpo.check_no_cross_attention(model, s.vocab, ctx.device, ctx.bf16, length=256)
            r[f"start_up_check_{backend}"] = "passed"
        except RuntimeError as e:
            r[f"start_up_check_{backend}"] = str(e)[:200]
    return r


def _kernels(fn, top: int = 6) -> list[str]:
    """The CUDA kernels that took most time in one call of `fn` (names cut to 90 characters)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    evs.sort(key=lambda e: -e.device_time_total)
    return [f"{e.key[:90]} {e.device_time_total / 1e3:.1f}ms" for e in evs[:top]]


# ------------------------------------------------------------------------------------- 5. fingerprint
def fingerprint(ctx: Context) -> dict:
    """The engine side's probe (a one-hot input through a bf16 linear layer, here F.linear: cuBLAS on a
    GPU) against the publisher's `probe_sum` arithmetic: equal bit sums, element for element."""
    import torch.nn.functional as F

    from exgrpo_async.fingerprint import bitsum, probe_columns, probe_sum

    s = TINY_15B if ctx.tiny else QWEN25_15B
    shapes = {"qkv+bias": (s.hidden + 2 * s.kv, s.hidden, True), "o_proj": (s.hidden, s.hidden, False),
              "gate_up": (2 * s.intermediate, s.hidden, False), "down": (s.hidden, s.intermediate, False),
              "lm_head": (s.vocab, s.hidden, False)}
    r, g = {}, torch.Generator(device=ctx.device).manual_seed(0)
    for name, (out_f, in_f, has_bias) in shapes.items():
        w = (torch.randn(out_f, in_f, generator=g, device=ctx.device) * 0.02).bfloat16()
        b = (torch.randn(out_f, generator=g, device=ctx.device) * 0.02).bfloat16() if has_bias else None
        cols = probe_columns(in_f)
        x = torch.zeros(len(cols), in_f, dtype=torch.bfloat16, device=ctx.device)
        x[torch.arange(len(cols)), torch.tensor(cols)] = 1
        y = F.linear(x, w, b)
        want = w[:, cols].float() + (b.float()[:, None] if b is not None else 0)
        r[name] = {"bitsum_equal": bitsum(y) == probe_sum(w, b),
                   "elements_differing": int((y.t().float() != want.to(torch.bfloat16).float()).sum())}
    r["all_exact"] = all(v["bitsum_equal"] for v in r.values())
    return r


# -------------------------------------------------------------------------------------------- 6. head
def head(ctx: Context) -> dict:
    """The output head (fp32 logits, checkpointed chunks) over 16k positions at several chunk sizes."""
    from learner.maths.grpo import token_logprobs

    s = TINY_15B if ctx.tiny else QWEN25_15B
    rows, width = (4, 128) if ctx.tiny else (4, 4096)
    model = _model(s, 1, ctx.device, max_positions=width)
    model.train()
    ids = torch.randint(3, s.vocab, (rows, width), device=ctx.device)
    r = {"positions": rows * width, "vocab": s.vocab}
    for chunk in ([64, 128, 256] if ctx.tiny else [512, 1024, 2048, 4096]):
        def step():
            model.zero_grad(set_to_none=True)
            lp, ent = token_logprobs(model, ids, None, with_entropy=True, chunk_tokens=chunk, bf16=ctx.bf16)
            (lp.sum() + 1e-3 * ent.sum()).backward()

        base = ctx.reset_peak()
        sec = _timed(ctx, step, repeats=2)
        peak = ctx.peak()
        r[f"chunk_{chunk}"] = {"fwd_bwd_ms": sec * 1e3,
                               "peak_above_start_gb": (peak - base) / 1e9 if peak is not None else None}
    return r


# ---------------------------------------------------------------------------------------- 7. step_1.5b
def _step_cfg(path: str, budget: int, max_new: int):
    from exgrpo_async.config_io import load_config

    cfg = load_config(REPO / "configs" / path, ["learner.world_size=1", "learner.mixed_precision=bf16"])
    cfg.learner.max_tokens_per_micro_batch = budget
    cfg.rollout.max_new_tokens = max_new
    return cfg


def _seqs(n_groups: int, k: int, vocab: int, prompt: tuple[int, int], comp: tuple[int, int], seed: int):
    from learner.maths.batch import Seq

    rng = random.Random(seed)
    out = []
    for gi in range(n_groups):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))]
        for _ in range(k):
            c = [rng.randrange(3, vocab) for _ in range(rng.randint(*comp))]
            out.append(Seq(p, c, torch.full((len(c),), -2.0), rng.choice([-0.5, 0.5]), 0, gi, False, False))
    return out


def _flops(s: Shape, layers: int, lengths: list[int], rows_widths: list[int] | None) -> float:
    """Model FLOPs of one training step (forward + backward, recompute not counted): 6 x the matmul
    parameters (the head included) per token, plus attention: causal within each sequence, or, with
    `rows_widths`, what SDPA computes over block-masked packed rows (every pair of a row, non-causal)."""
    p = s.params(layers) - s.vocab * s.hidden * (1 if s.tied else 2) + s.vocab * s.hidden
    tokens = sum(lengths)
    attn = (3 * layers * sum(4 * w * w * s.hidden for w in rows_widths) if rows_widths is not None
            else 3 * layers * sum(2 * n * n * s.hidden for n in lengths))
    return 6 * p * tokens + attn


def _row_widths(batch: list, cfg, budget: int) -> list[int]:
    """The packed rows' widths for the "as computed" FLOPs: the step's sequences cut into micro-batches
    as one mini-batch (an approximation: the step cuts each of its mini-batches apart)."""
    from learner.maths.packing import pack_rows
    from learner.maths.update import cut_micro_batches

    parts = cut_micro_batches(batch, list(range(len(batch))), cfg.learner)
    return [pack_rows([batch[i].prompt for i in part], [batch[i].completion for i in part], 0,
                      budget).input_ids.shape[1] for part in parts]


def step_15b(ctx: Context) -> dict:
    """`update_policy` at the 1.5B shape (packed 16k rows, 2 mini-batches) on each wrapper, attention
    backend and AdamW, with and without bf16 working weights, eager (gradient checkpointing) and compiled
    (learner/maths/compiled.py: without checkpointing, the attention outside the layers' graphs ("_no_ckpt")
    or inside them ("_whole": as configs/qwen2.5-math-1.5b-8gpu.toml trains on a GPU); the head alone; the
    layers with their checkpoint inside their graphs)."""
    from learner.maths import attention as att
    from learner.maths.grpo import LogProbs
    from learner.policy import param_groups, shard
    from learner.ranks import Ranks

    s = TINY_15B if ctx.tiny else QWEN25_15B
    budget, max_new = (512, 96) if ctx.tiny else (16384, 3072)
    prompt, comp = ((8, 24), (16, 96)) if ctx.tiny else ((100, 600), (200, 3072))
    cfg = _step_cfg("qwen2.5-math-1.5b-8gpu.toml", budget, max_new)
    torch._dynamo.config.recompile_limit = 64  # many compiled set-ups in one process (learner/maths/compiled.py: 16)
    cfg.learner.lr = 1e-30  # the same kernels; updates below any fp32 weight's spacing: weights that never move (`_match`)
    ctx.dist()
    model = _model(s, s.layers, ctx.device, max_positions=budget)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ranks = Ranks(0, 1, ctx.device)
    fast = "varlen" if att.varlen_available(ctx.device) else "per_sequence"
    # (wrapper, attention, fused AdamW, compiled regions, bf16 working weights: learner/maths/working_weights.py,
    # the unsharded learner's way in bf16)
    ww = ctx.bf16
    variants = [("unsharded", "sdpa", False, False, False), ("unsharded", fast, False, False, False),
                ("unsharded", fast, True, False, False), ("unsharded", fast, True, False, ww),
                ("unsharded", fast, True, True, False), ("unsharded", fast, True, True, ww),
                ("unsharded", fast, True, "head", ww), ("unsharded", fast, True, "ckpt", ww),
                ("fsdp2", fast, True, False, False), ("fsdp2", fast, True, True, False),
                ("fsdp2", fast, True, "head", False), ("unsharded", fast, True, "whole", ww)]
    if ctx.cuda:  # on CPU (torch 2.13, gloo) FSDP2's compiled checkpointed layers meet an Inductor input
        # assertion ("expected size 10==2") in the no-grad pass; on the H200 (torch 2.11) they ran and matched
        variants.append(("fsdp2", fast, True, "ckpt", False))
    r = {"shape": s.name, "budget": budget, "peak_bf16_flops": ctx.peak_flops,
         "memory_model_gb_world1": rank_bytes(s, budget, 1) / 1e9}
    forward = LogProbs(model)
    # compiled: learner/maths/compiled.py's regions, layers and head without gradient checkpointing, the head
    # alone with checkpointing, or both with the checkpoint inside each layer's graph ("ckpt": what
    # learner.compile "auto" runs with checkpointing now)
    suffix = {False: "", True: "_compiled_no_ckpt", "head": "_compiled_head", "ckpt": "_compiled_ckpt",
              "whole": "_compiled_whole"}
    names = lambda v: f"{v[0]}_{v[1]}_{'fused' if v[2] else 'foreach'}{suffix[v[3]]}{'_ww' if v[4] else ''}"  # noqa: E731
    variants = list({names(v): v for v in variants if ctx.wants(names(v))}.values())  # on CPU "_ww" is off
    for wrapper, backend, fused, compile_it, working in variants:
        if wrapper == "fsdp2" and not hasattr(forward, "reshard"):  # the last variants: FSDP2 owns the model now
            model.zero_grad(set_to_none=True)
            _working(model, forward, False)
            forward = shard(model, "bf16")
        else:
            _working(model, forward, working)
        _compiled(model, forward, compile_it)
        if compile_it in (True, "whole"):
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compile_it == "ckpt":
            for layer in model.model.layers:  # the checkpoint is inside each compiled layer (learner/maths/compiled.py)
                layer.gradient_checkpointing = False
        att.use(model, backend, traceable=compile_it in ("ckpt", "whole"))
        opt = torch.optim.AdamW(param_groups(model), lr=cfg.learner.lr, betas=(0.9, 0.999), weight_decay=0.01,
                                fused=fused and ctx.cuda)
        seqs = lambda k: _seqs(4, 8, s.vocab, prompt, comp, k)  # noqa: E731
        name = names((wrapper, backend, fused, compile_it, working))
        try:
            r[name] = _timed_step(ctx, s, cfg, forward, opt, seqs, ranks, budget, backend, compile_it)
        except Exception as e:  # noqa: BLE001 (new on a GPU: its error is the finding; the variants after go on)
            if compile_it not in ("ckpt", "whole"):
                raise
            r[name] = {"error": f"{type(e).__name__}: {str(e)[:4000]}"}
            ctx.partial("step_1.5b", r)
            continue
        _match(r, name, wrapper)
        ctx.partial("step_1.5b", r)  # written now: a timeout in a later (compiled, slower) variant keeps these
        del opt
        ctx.free()
    _compiled(model, forward, False)
    _working(model, forward, False)
    ctx.keep["model_15b"] = model
    return r


def _timed_step(ctx: Context, s: Shape, cfg, forward, opt, seqs, ranks, budget: int, backend: str,
                compile_it: bool | str) -> dict:
    """One step_1.5b variant: warmed up (compiled: until nothing new compiles), then `ctx.steps` timed steps."""
    from learner.maths.update import StepSettings, update_policy

    t_warm = time.perf_counter()
    warm_ups = _warm_up(ctx, functools.partial(_one_step, forward, opt, seqs, cfg, ctx.device, ranks), compile_it)
    t_warm = time.perf_counter() - t_warm
    graphs = _graphs()
    base = ctx.reset_peak()
    times, tokens, flops_model, flops_hw, phases, first = [], 0, 0.0, 0.0, [], None
    for k in range(ctx.steps):
        batch = seqs(k + 1)
        lengths = [len(q.prompt) + len(q.completion) for q in batch]
        widths = _row_widths(batch, cfg, budget)
        ctx.sync()
        t0 = time.perf_counter()
        res = update_policy(forward, opt, batch, 4, cfg, StepSettings(clip=0.2), ctx.device, 0, k + 1, ranks)
        ctx.sync()
        times.append(time.perf_counter() - t0)
        tokens += sum(lengths)
        flops_model += _flops(s, s.layers, lengths, None)
        flops_hw += _flops(s, s.layers, lengths, widths if backend == "sdpa" else None)
        phases.append(res.seconds)
        first = first or {"losses": res.losses, "grad_norms": res.norms}
    total = sum(times)
    pf = ctx.peak_flops
    return {"seconds_per_step": total / len(times), "tokens_per_s": tokens / total,
            "tokens_per_step": tokens / len(times),
            "phases_s": {k: statistics.mean(p[k] for p in phases) for k in phases[0]},
            "peak_gb": (ctx.peak() or 0) / 1e9, "peak_above_start_gb": ((ctx.peak() or 0) - base) / 1e9,
            "mfu_6n_causal": flops_model / total / pf if pf else None,
            "mfu_as_computed": flops_hw / total / pf if pf else None,
            "warm_up_s": t_warm, "warm_up_steps": warm_ups, "compiled_graphs": _graphs(),
            "graphs_compiled_while_timed": _graphs() - graphs,
            "first_step": first}  # the same batch in every variant: compare them (`_match`)


def _match(r: dict, name: str, wrapper: str) -> None:
    """How far a variant's first timed step (the same batch and weights in every variant) is from the eager
    step's on the same wrapper: the largest relative difference of its losses and grad norms."""
    ref = next((v for k, v in r.items() if isinstance(v, dict) and k.startswith(wrapper) and "first_step" in v
                and k.endswith(("_fused", "_fused_ww"))), None)
    if ref is None or ref is r[name]:
        return
    a, b = r[name]["first_step"], ref["first_step"]
    r[name]["match_vs_eager"] = max(abs(x - y) / max(abs(y), 1e-12) for key in a for x, y in zip(a[key], b[key]))


def _working(model, forward, on: bool) -> None:
    """bf16 working weights on the unsharded model (learner/maths/working_weights.py), or the plain linear
    layers back (autocast's casts)."""
    from learner.maths.working_weights import WorkingWeights

    if on and getattr(forward, "working", None) is None:
        forward.working = WorkingWeights(model)
    elif not on and getattr(forward, "working", None) is not None:
        forward.working.remove()
        forward.working = None


def _one_step(forward, opt, seqs, cfg, device, ranks, k: int) -> None:
    from learner.maths.update import StepSettings, update_policy

    update_policy(forward, opt, seqs(k), 4, cfg, StepSettings(clip=0.2), device, 0, 0, ranks)


def _warm_up(ctx: Context, step, compiled: bool | str) -> int:
    """One warm-up step; compiled, more (other batches: seeds 101, 102, ...) while a step still compiles new
    graphs (the compiler specialises a few shape ranges and grad mode, each met first in some step), so the
    timed steps time the compiled step, not its compiles: up to 4 (2 in the CPU rehearsal, whose figures are
    not timings). Returns the warm-up steps taken."""
    most = 2 if ctx.tiny else 4
    for n in range(1, most + 1):
        before = _graphs()
        step(0 if n == 1 else 100 + n)
        ctx.sync()
        if not compiled or (n > 1 and _graphs() == before):
            return n
    return most


def _compiled(model, forward, on: bool | str) -> None:
    """Compile the model's regions as `learner.compile` does (learner/maths/compiled.py), or put them back eager;
    "head": the head alone (its checkpoint inside its graph), the layers eager; "ckpt": both, each layer
    with its checkpoint inside its graph."""
    from learner.maths import compiled

    for layer in model.model.layers:  # eager first (a former variant may have compiled them another way)
        vars(layer).pop("forward", None)
    if on in (True, "ckpt", "whole"):  # "whole": no checkpoint, the attention traceable (in the graph)
        compiled.compile_layers(model, checkpointed=on == "ckpt")
    forward.compile_head(bool(on))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ------------------------------------------------------------------------------------------ 7b. profile
CATEGORIES = (("attention", ("flash", "fmha", "sdpa", "attn")), ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
              ("optimizer", ("multi_tensor", "adam")), ("nccl", ("nccl",)),
              ("copy_cast", ("copy", "cast")), ("reduce", ("reduce", "softmax", "logsumexp", "norm")))


def _category(kernel: str) -> str:
    k = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(x in k for x in keys)), "elementwise_other")


def profile(ctx: Context) -> dict:
    """Where the 1.5B step's GPU time goes (varlen attention, fused AdamW, one rank as the 1.5B config
    trains): kernel time by category over one step, eager and compiled, with the step's synchronising calls
    and the device's idle time (ops/bench/gpu/gpu_gaps.py); the step compiled without gradient checkpointing;
    on request (ON_REQUEST) the head's chunk at 512 positions, eager without checkpointing and the head
    alone compiled; and last the layers compiled under checkpointing, the checkpoint inside each layer's
    graph (learner/maths/compiled.py; new on a GPU: its time and kernels, or the step's error if it meets one)."""
    from learner.maths import attention as att
    from learner.maths import compiled
    from learner.maths import grpo
    from learner.maths.grpo import LogProbs
    from learner.ranks import Ranks

    s = TINY_15B if ctx.tiny else QWEN25_15B
    budget, max_new = (512, 96) if ctx.tiny else (16384, 3072)
    prompt, comp = ((8, 24), (16, 96)) if ctx.tiny else ((100, 600), (200, 3072))
    cfg = _step_cfg("qwen2.5-math-1.5b-8gpu.toml", budget, max_new)
    model = _model(s, s.layers, ctx.device, max_positions=budget)
    backend = "varlen" if att.varlen_available(ctx.device) else "per_sequence"
    forward, ranks = LogProbs(model), Ranks(0, 1, ctx.device)
    _working(model, forward, ctx.bf16)  # as the unsharded learner computes in bf16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=ctx.cuda)
    batches = {k: _seqs(4, 8, s.vocab, prompt, comp, k) for k in (0, *range(1, ctx.steps + 1), 97, 98, 99, 102, 103, 104)}
    batch = batches.__getitem__  # built before the timing
    step = functools.partial(_one_step, forward, opt, batch, cfg, ctx.device, ranks)
    r = {"head_chunk_auto": grpo.logit_chunk(s.vocab, ctx.device)}
    auto = grpo.logit_chunk
    for name, checkpointing, chunk, compile_it in (
            ("checkpointing_chunk_auto", True, None, False), ("checkpointing_chunk_512", True, 512, False),
            ("no_checkpointing_chunk_auto", False, None, False), ("compiled_no_checkpointing", False, None, True),
            ("compiled_head_checkpointing", True, None, "head"), ("compiled_checkpointing", True, None, "ckpt")):
        if not ctx.wants(name):
            continue
        _compiled(model, forward, compile_it)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        if compile_it == "ckpt":
            for layer in model.model.layers:  # the checkpoint is inside each compiled layer
                layer.gradient_checkpointing = False
        # as a config with these regions runs (learner/maths/compiled.py; the 1.5B one: varlen in the layers' graph)
        regions = compiled.Regions(layers=compile_it in (True, "ckpt"), head=bool(compile_it))
        att.use(model, backend, traceable=compiled.attention_in_graph(regions, checkpointing, backend))
        grpo.logit_chunk = auto if chunk is None else (lambda vocab, device=None, c=chunk: c)
        probe = name == "compiled_checkpointing"  # new on a GPU: its time, or the error it met
        try:
            graphs = _graphs()
            warm_ups = _warm_up(ctx, step, compile_it)
            graphs_warm = _graphs()
            base = ctx.reset_peak()
            times, tokens = [], 0
            for k in range(ctx.steps):
                ctx.sync()
                t0 = time.perf_counter()
                step(k + 1)
                ctx.sync()
                times.append(time.perf_counter() - t0)
                tokens += sum(len(q.prompt) + len(q.completion) for q in batch(k + 1))
            flops = sum(_flops(s, s.layers, [len(q.prompt) + len(q.completion) for q in batch(k + 1)], None)
                        for k in range(ctx.steps))
            r[name] = {"seconds_per_step": sum(times) / len(times), "tokens_per_s": tokens / sum(times),
                       "peak_gb": (ctx.peak() or 0) / 1e9, "peak_above_start_gb": ((ctx.peak() or 0) - base) / 1e9,
                       "mfu_6n_causal": flops / sum(times) / ctx.peak_flops if ctx.peak_flops else None,
                       "warm_up_steps": warm_ups, "graphs_compiled_in_warm_up": graphs_warm - graphs,
                       "graphs_compiled_while_timed": _graphs() - graphs_warm}
            if name in ("checkpointing_chunk_auto", "compiled_no_checkpointing", "compiled_checkpointing"):
                if ctx.cuda:
                    r[f"kernel_time_{name}"] = _by_category(lambda: step(99))
                r[f"host_syncs_{name}"] = gpu_gaps.sync_sites(lambda: step(98))
                keep = ctx.out / f"trace-{name}.json.gz" if ctx.out is not None else None
                r[f"idle_{name}"] = gpu_gaps.idle_gaps(gpu_gaps.trace_of(lambda: step(97), keep))
            ctx.partial("profile", r)
        except Exception as e:  # noqa: BLE001
            if not probe:
                raise
            r[name] = {"error": f"{type(e).__name__}: {str(e)[:4000]}"}
        finally:
            grpo.logit_chunk = auto
    _compiled(model, forward, False)
    _working(model, forward, False)
    return r


def _by_category(fn, top: int = 40) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_

    with prof_(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    tops: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) / 1e3
        if t <= 0:
            continue
        c = _category(e.key)
        totals[c] = totals.get(c, 0.0) + t
        tops[e.key[:120]] = tops.get(e.key[:120], 0.0) + t
    whole = sum(totals.values())
    return {"total_ms": whole, "share": {c: round(t / whole, 3) for c, t in sorted(totals.items(), key=lambda x: -x[1])},
            "top_kernels_ms": dict(sorted(tops.items(), key=lambda x: -x[1])[:top])}


# ---------------------------------------------------------------------------------------- 8. memory_7b
def memory_7b(ctx: Context) -> dict:
    """The 7B shape with 4 of its 28 layers, FSDP2 on one rank as the 7B ranks run it (bf16 compute, fp32
    masters, fused AdamW, gradient checkpointing, 16k-token micro-batches): the step's peak against the
    memory model at that depth; then two publishes and the buffer sets they leave on the device."""
    from exgrpo_async.weight_sync import WeightPublisher
    from learner.maths import attention as att
    from learner.maths.update import StepSettings, update_policy
    from learner.model import named_parameters_for_sync
    from learner.policy import param_groups, shard
    from learner.ranks import Ranks

    full = TINY_7B if ctx.tiny else QWEN25_7B
    layers = 2 if ctx.tiny else 4
    s = dataclasses.replace(full, layers=layers)
    budget, max_new = (512, 128) if ctx.tiny else (16384, 8192)
    prompt, comp = ((8, 24), (32, 128)) if ctx.tiny else ((100, 600), (1000, 3000))
    cfg = _step_cfg("qwen2.5-math-7b-8gpu.toml", budget, max_new)
    ctx.dist()
    model = _model(s, layers, ctx.device, max_positions=budget)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backend = "varlen" if att.varlen_available(ctx.device) else "per_sequence"
    from learner.maths import compiled

    ckpt = cfg.learner.gradient_checkpointing
    regions = compiled.resolve(cfg.learner.compile, ctx.device, ckpt, backend)  # as the config runs
    att.use(model, backend, traceable=compiled.attention_in_graph(regions, ckpt, backend))
    if regions.layers:
        compiled.compile_layers(model, checkpointed=ckpt)
    forward = shard(model, "bf16", regions.head)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-6, fused=ctx.cuda)
    ranks = Ranks(0, 1, ctx.device)
    update_policy(forward, opt, _seqs(2, 8, s.vocab, prompt, comp, 0), 2, cfg, StepSettings(clip=0.2), ctx.device,
                  0, 0, ranks)
    ctx.reset_peak()
    update_policy(forward, opt, _seqs(2, 8, s.vocab, prompt, comp, 1), 2, cfg, StepSettings(clip=0.2), ctx.device,
                  0, 1, ranks)
    model_bytes = rank_bytes(s, budget, 1, sharded=True)  # FSDP2 on this one rank
    r = {"shape": f"{full.name}, {layers} layers", "compiled": str(regions), "params": s.params(), "step_peak_gb": (ctx.peak() or 0) / 1e9,
         "memory_model_gb": model_bytes / 1e9}
    r["measured_over_model"] = r["step_peak_gb"] / r["memory_model_gb"] if ctx.cuda else None
    before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    # as the learner on a GPU keeps them (weight_sync.publish_sets unset: one set, repacked in place)
    pub = WeightPublisher("127.0.0.1", 0, "nccl" if ctx.cuda else "gloo", ctx.device, bucket_mb=256, timeout_s=60,
                          max_sets=1)
    for v in range(2):
        pub.publish(v, named_parameters_for_sync(model), torch.bfloat16)
    set_bytes = sum(b.numel() * b.element_size() for b in pub._sets[0])
    r.update(publish_sets_after_two=len(pub._sets), publish_set_gb=set_bytes / 1e9,
             publish_allocated_gb=((torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0) - before) / 1e9)
    full_set = 2 * full.params()
    world4 = rank_bytes(full, budget, 4)  # the lead's figure: learner/maths/memory_model.py lead_bytes
    r["projected_lead_peak_gb_28_layers_world4"] = {
        "memory_model_rank": world4 / 1e9,
        "plus_sets_as_measured": (world4 + r["publish_sets_after_two"] * full_set) / 1e9,
        "scaled_by_measured_ratio": ((world4 * (r["measured_over_model"] or 1.0)) + r["publish_sets_after_two"]
                                     * full_set) / 1e9}
    if ctx.cuda:
        r["device_total_gb"] = torch.cuda.get_device_properties(ctx.device).total_memory / 1e9
    r["h100_80gb_total_gb"] = 85.52
    del pub, opt, forward, model
    return r


def load(ctx: Context) -> dict:
    """How learner ranks load the policy when there are several (learner/policy.py `receive_weights`),
    on this one rank's NCCL group: the 1.5B shape with 2 layers saved as a Hugging Face folder, built on
    the meta device, sharded, given storage on the GPU and filled by the broadcast from rank 0, against
    the model read onto the GPU whole (the way every rank loaded before). With one rank its shards are
    the whole model, so the peaks differ only by the tensor in transit; what this checks is the CUDA path
    (storage for a meta model on the device, buffers kept, ties kept, NCCL's broadcast of a state dict)
    and that the result is the checkpoint exactly."""
    import tempfile
    from pathlib import Path

    from learner.model import load_policy, policy_skeleton
    from learner.policy import receive_weights, shard
    from learner.ranks import Ranks

    full = TINY_15B if ctx.tiny else QWEN25_15B
    s = dataclasses.replace(full, layers=2)
    ctx.dist()
    r: dict = {"shape": f"{full.name}, 2 layers", "params": s.params()}
    with tempfile.TemporaryDirectory() as tmp:
        from exgrpo_async.toy.task import build_tokenizer

        _model(s, 2, torch.device("cpu")).save_pretrained(tmp)
        build_tokenizer(Path(tmp))
        base = ctx.reset_peak()
        t0 = time.perf_counter()
        whole, _ = load_policy(tmp, "float32", ctx.device)
        ctx.sync()
        r["whole_seconds"], r["whole_peak_gb"] = time.perf_counter() - t0, ((ctx.peak() or 0) - base) / 1e9
        expected = {k: v.detach().cpu().clone() for k, v in whole.state_dict().items()}
        del whole
        ctx.free()
        base = ctx.reset_peak()
        t0 = time.perf_counter()
        model, _ = policy_skeleton(tmp)
        shard(model, "bf16")
        receive_weights(model, tmp, Ranks(0, 1, ctx.device), ctx.device)
        ctx.sync()
        r["rank0_seconds"], r["rank0_peak_gb"] = time.perf_counter() - t0, ((ctx.peak() or 0) - base) / 1e9
        got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        r["tensors"], r["tensors_differing"] = len(expected), sum(
            1 for k, v in expected.items() if not torch.equal(got[k].detach().cpu(), v))
        r["on_device"] = all(p.device == ctx.device for p in model.parameters())
        r["tied_kept"] = model.lm_head.weight is model.model.embed_tokens.weight
        del model, got
    return r


# -------------------------------------------------------------------------------------------- 9. sync
def sync(ctx: Context) -> dict:
    from gpu_sync_check import planner_results, publish_rate, receive_hazard

    r = {"placement": planner_results(torch.cuda.device_count() if ctx.cuda else 0)}
    model = ctx.keep.pop("model_15b", None)
    if model is None:
        s = TINY_15B if ctx.tiny else QWEN25_15B
        model = _model(s, s.layers, ctx.device)
    r["publish"] = publish_rate(model, ctx.device)
    del model
    ctx.free()
    r["receive_hazard"] = receive_hazard(ctx.device) if ctx.cuda else "skipped: needs CUDA streams"
    return r


# ------------------------------------------------------------------------------------------- 10. stall
def stall(ctx: Context) -> dict:
    """A two-rank NCCL group whose second rank never comes: the first broadcast as the code before
    `warm_up` made it (in a thread we watch), then `open_group` as it is now (warm-up under the deadline)."""
    if not ctx.cuda:
        return {"skipped": "needs NCCL (gloo forms its group in the constructor, under the store's timeout)"}
    from exgrpo_async.weight_sync import SyncTimeout, WeightPublisher, _broadcast, make_group

    r = {}
    pub = WeightPublisher("127.0.0.1", 0, "nccl", ctx.device, bucket_mb=256, timeout_s=5)
    pg = make_group(pub.host, pub.port, "ws/lazy/", 0, 2, "nccl", 5)  # no warm-up: the old open_group
    box = {}

    def first():
        t0 = time.perf_counter()
        try:
            box["work"] = _broadcast(pg, torch.zeros(1, device=ctx.device))
            box["returned_s"] = time.perf_counter() - t0
        except Exception as e:  # recorded
            box["error"] = f"{type(e).__name__}: {e}"[:300]

    t = threading.Thread(target=first, daemon=True)
    t.start()
    t.join(10)
    r["lazy_first_broadcast_blocks_host"] = t.is_alive()
    r["lazy_first_broadcast"] = {k: v for k, v in box.items() if k != "work"}
    if t.is_alive():
        t0 = time.perf_counter()
        aborter = threading.Thread(target=pg.abort, daemon=True)
        aborter.start()
        aborter.join(15)
        r["lazy_abort_returned"] = not aborter.is_alive()
        t.join(max(0.0, 15 - (time.perf_counter() - t0)))
        r["lazy_after_abort_thread_ended"] = not t.is_alive()
        r["lazy_abort_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        pub.open_group("ghost", 2)
        r["open_group_with_warm_up"] = "formed (unexpected)"
    except SyncTimeout as e:
        r["open_group_with_warm_up"] = f"SyncTimeout after {time.perf_counter() - t0:.1f}s: {e}"
    except Exception as e:  # recorded
        r["open_group_with_warm_up"] = f"{type(e).__name__} after {time.perf_counter() - t0:.1f}s: {e}"[:300]
    names = lambda: [th.name for th in threading.enumerate() if th.name in ("ws-warm-up", "ws-abort")]  # noqa: E731
    r["threads_at_return"] = names()
    time.sleep(5)
    r["threads_left_after_5s"] = names()
    return r
