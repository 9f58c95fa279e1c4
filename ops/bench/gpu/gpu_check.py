"""GPU check (issue 34): what one bare GPU can say about the learner and weight sync, in minutes.

Made for a one-GPU machine with Python 3.12, torch with CUDA, transformers, msgpack, psutil and numpy, and
no network (`ops/gpu-check` installs the wheels carried in `.whl/` first; `ops/gpu-wheels` downloads them).
Sections run cheap and crash-prone first; each one's figures (or its traceback) are written to
`OUT/gpu_check.json` as soon as it ends, so a timeout or a crash keeps what was measured:

 1. env        versions, the device, which attention kernels this torch has
 2. imports    the import closure of the learner and weight-sync modules
 3. nccl       a one-rank NCCL group as weight sync builds it: a 256 MB broadcast, completion polling, abort
 4. attention  a packed 16k-token row at the 1.5B width: each backend against every sequence alone
               (max |d logp|), forward+backward ms, peak memory, the kernels the profiler saw
 5. kernels    one packed 16k row of the 1.5B attention through each kernel this torch has (FlashAttention-2
               with the longest segment and with the row's width as bound, cuDNN's variable-length kernel,
               cuDNN and flash SDPA per sequence): ms, TFLOP/s, agreement (ops/bench/gpu/gpu_kernels.py)
 6. fingerprint  the fingerprint's one-hot probes through cuBLAS against the publisher's arithmetic, bit for bit
 7. head       the output head over 16k positions at chunk sizes 512-4096: ms and peak memory
 8. step_1.5b  the learner's own `update_policy` at the Qwen2.5-Math-1.5B shape on both real wrappers
               (one rank unsharded under autocast, as the 1.5B config trains; FSDP2, as the 7B ranks
               do), sdpa against varlen attention, foreach against fused AdamW, with and without bf16
               working weights (learner/maths/working_weights.py, "_ww"), eager against compiled regions
               (learner/maths/compiled.py: layers and head without gradient checkpointing, the head alone with
               it, or both with the checkpoint inside each layer's graph, "_compiled_ckpt"): tokens/s,
               phase times, peak memory against learner/maths/memory_model.py, MFU counted two ways, the
               compiled variants' warm-up (until a step compiles nothing new), and each variant's first
               step (the same batch) against the eager one's ("match_vs_eager")
 9. profile    the 1.5B step's GPU time by kernel category, eager and compiled, with its synchronising
               calls by line and the device's idle time by what launched the kernel after it
               (ops/bench/gpu/gpu_gaps.py; the traces gzipped beside the JSON), and the layers compiled
               under checkpointing (its error, if any: new on a GPU). Variants measured
               before that no config runs go only when `--variants` names them (ON_REQUEST in the sections)
10. memory_7b  the 7B shape with a few layers under FSDP2: peak against the memory model at that depth,
               the publisher's buffer sets after two publishes, the lead's projected peak at 28 layers
11. load       the learner ranks' load (the meta-device model, sharded, filled from rank 0's broadcast) on
               this rank's NCCL group, against the model read onto the GPU whole: exact, seconds, peaks
12. sync       ops/bench/gpu/gpu_sync_check.py: the planner on this machine's devices; publish GB/s; the
               receive-buffer hazard (a loader keeping a view past the next bucket) on CUDA streams
13. stall      a two-rank NCCL group whose peer never comes: whether the first broadcast blocks the
               host, and whether weight sync's deadline frees it (last: it may leave a thread stuck)

    ops/gpu-check --out OUT                      # on the GPU machine (PYTHONUNBUFFERED, wheels, this file)
    # the CPU rehearsal (with Inductor's C++ kernels instead of aot_eager: a minute more)
    .venv/bin/python ops/bench/gpu/gpu_check.py --device cpu --tiny --compile-backend aot_eager --out bench_out/gpu_cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402  (the repository importable: on a bare GPU machine nothing is installed)

from exgrpo_async.startup import without_gc  # noqa: E402

with without_gc():  # torch's import, frozen: the compiled variants' collections do not rescan it
    import gpu_check_sections as sec  # noqa: E402

SECTIONS = ["env", "imports", "nccl", "attention", "kernels", "fingerprint", "head", "step_1.5b", "profile", "memory_7b", "load",
            "sync", "stall"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy shapes: the CPU rehearsal of every section")
    bench.add_out(ap, "gpu_check", help="folder for gpu_check.json")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections, in this file's order")
    ap.add_argument("--steps", type=int, default=2, help="timed learner steps per variant (after one warm-up)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants of step_1.5b and profile to run (names as in the JSON); "
                         "default all")
    ap.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager"),
                    help="the compiler of the compiled variants (learner/maths/compiled.py BACKEND); the CPU "
                         "rehearsal's aot_eager traces every region without generating C++ kernels")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                     "compile_backend": a.compile_backend, "sections": {}}
    from learner.maths import compiled

    compiled.BACKEND = a.compile_backend
    ctx = sec.Context(a.device, a.tiny, a.steps, a.variants.split(",") if a.variants else None)
    partial: dict[str, dict] = {}  # a long section's figures so far: kept beside its error if it fails later

    def on_partial(name: str, figures: dict) -> None:
        partial[name] = dict(figures)
        bench.write_json(path, dict(results, sections={**results["sections"], name: dict(figures, partial=True)}),
                         indent=1, default=str, say=False)

    ctx.on_partial = on_partial
    ctx.out = out
    wanted = [s for s in SECTIONS if s in a.only.split(",")]
    for name in wanted:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            res = getattr(sec, name.replace(".", "").replace("-", "_"))(ctx)
        except Exception:  # a section's failure is its result; the next section still runs
            res = {**partial.get(name, {}), "error": traceback.format_exc(limit=12)}
            print(res["error"], flush=True)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results["sections"][name] = res
        for k, v in res.items():
            if k != "error":
                print(f"  {k:34s} {json.dumps(v, default=str)[:300]}", flush=True)
        bench.write_json(path, results, indent=1, default=str, say=False)
        ctx.free()
        gc.collect()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    bench.write_json(path, results, indent=1, default=str)
    sys.stdout.flush()
    os._exit(0)  # a stalled NCCL communicator (section stall) must not hold the interpreter's exit


if __name__ == "__main__":
    main()
