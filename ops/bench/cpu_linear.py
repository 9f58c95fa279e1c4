"""vLLM on CPU: oneDNN-prepacked linear layers (the default) against plain torch F.linear.

Why: with prepacked weights a weight sync must go through vLLM's layerwise reload and re-pack every
linear layer (most of the sync's cost at 113M, docs/benchmarks.md); with plain F.linear the weights
stay ordinary tensors and `model.load_weights` copies into them directly. This measures what that
would cost in generation speed. One process per (model, mode), in-process engine core, 1 torch
thread, 64 MiB KV cache; 32 prompts x n=8 x 64 tokens (ignore_eos) at T=1 after a 2-prompt warm-up;
"plain" flips `vllm._custom_ops._supports_onednn` off before the engine builds its layers and then
times `model.load_weights` of the Hugging Face weights (second of two calls).

    .venv/bin/python ops/bench/cpu_linear.py [--models toy,113m] [--out bench_out/cpu_linear.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child(path: str, mode: str) -> None:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_CI_ENV="1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    import torch

    torch.set_num_threads(1)
    import vllm._custom_ops as ops

    if mode == "plain":
        ops._supports_onednn = False
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=64 << 20)
    prompts = [f"<bos>{i}+{i * 3}=" for i in range(32)]
    sp = SamplingParams(n=8, temperature=1.0, max_tokens=64, logprobs=0, detokenize=False, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    load_s = None
    if mode == "plain":
        from transformers import AutoModelForCausalLM

        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        named = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()]
        for _ in range(2):
            t0 = time.perf_counter()
            model.load_weights(weights=iter(named))
            load_s = time.perf_counter() - t0
    print(json.dumps({"tok_per_s": tokens / gen_s, "load_weights_s": load_s}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="toy,113m")
    ap.add_argument("--out", default=str(REPO / "bench_out" / "cpu_linear.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weight_sync import build_policy

    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    results = []
    for size in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            build_policy(Path(tmp), size)
            row = {"model": size}
            for mode in ("onednn", "plain"):
                out = subprocess.run([sys.executable, __file__, "--child", tmp, mode], capture_output=True, text=True,
                                     env=env, cwd=REPO, check=True).stdout.strip().splitlines()[-1]
                row[mode] = json.loads(out)
            results.append(row)
    print(f"{'model':>6} {'oneDNN tok/s':>13} {'plain tok/s':>12} {'plain/oneDNN':>13} {'plain load_weights (s)':>23}")
    for r in results:
        print(f"{r['model']:>6} {r['onednn']['tok_per_s']:>13.0f} {r['plain']['tok_per_s']:>12.0f} "
              f"{r['plain']['tok_per_s'] / r['onednn']['tok_per_s']:>13.2f} {r['plain']['load_weights_s']:>23.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
