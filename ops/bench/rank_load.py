"""Learner ranks at start-up: each rank's peak memory while the policy is loaded and sharded, two ways.

At the shape of Qwen2.5-0.5B (every layer; fp32 master weights, 1.98 GB, tied embeddings), built from
a config with random weights and saved as a Hugging Face folder, `--world` learner ranks on gloo
(real processes, this CPU) construct the policy:
- every: each rank reads the whole checkpoint onto its device, then FSDP2 shards it (the learner
  before issue 34: a full fp32 copy per rank, 30 GB per GPU at 7B);
- lead: what `learner.policy.Policy` does now (`policy_skeleton`, `shard`, `receive_weights`): rank 0
  reads the checkpoint on its CPU, every rank builds the model on the meta device, shards it, allocates
  only its shards and receives them from rank 0, a tensor at a time.
Each rank reports its peak resident memory (VmHWM) above the memory it had before the load began, and
the seconds the load took (the ranks run with MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave
the resident set and the peak is what was alive at once). On a GPU node the "every" path's extra copy sits on the GPU (and in its
caching allocator afterwards); here everything is host memory.

    .venv/bin/python ops/bench/rank_load.py [--world 2] [--layers 24] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from learner_memory import _rss  # noqa: E402  (a /proc/self/status field, in bytes)

from learner.maths.memory_model import QWEN25_05B, qwen2_config  # noqa: E402


def _rank(rank: int, world: int, model: str, port: int, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from exgrpo_async.config import RunConfig
    from learner.ranks import Ranks

    torch.set_num_threads(1)
    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype, cfg.learner.world_size, cfg.learner.device = model, "float32", world, "cpu"
    cfg.learner.mixed_precision = "none"
    ranks = Ranks.from_env(world, "cpu", 600.0)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    base, t0 = _rss("VmRSS"), time.perf_counter()
    from learner.model import load_policy, policy_skeleton
    from learner.policy import receive_weights, shard

    if path == "lead":  # learner.policy.Policy's load for world size > 1
        m, _ = policy_skeleton(model)
        shard(m, "none")
        receive_weights(m, model, ranks, torch.device("cpu"))
    else:  # what it did before
        m, _ = load_policy(model, "float32", torch.device("cpu"))
        shard(m, "none")
    params = m.parameters()
    local = sum(p.to_local().numel() * 4 for p in params)
    row = {"path": path, "rank": rank, "peak_above_start_bytes": _rss("VmHWM") - base, "local_shard_bytes": local,
           "seconds": time.perf_counter() - t0}
    Path(out, f"{path}-{rank}.json").write_text(json.dumps(row))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # no finalization of gloo's workers (learner/ranks.py end_rank_process)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=QWEN25_05B.layers)
    ap.add_argument("--out", default="bench_out")
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    from transformers import Qwen2ForCausalLM

    from exgrpo_async.toy.task import build_tokenizer

    # glibc keeps freed blocks below its (growing) mmap threshold in the heap: the ranks' resident memory
    # would then hold every tensor ever freed. Allocations above 64 KiB go to mmap and return on free.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = Path(tmp, "model")
        Qwen2ForCausalLM(qwen2_config(QWEN25_05B, a.layers)).save_pretrained(str(model))
        build_tokenizer(model)
        for path in ("every", "lead"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_rank, args=(a.world, str(model), port, path, tmp), nprocs=a.world, join=True,
                               start_method="spawn")
            rows += [json.loads(Path(tmp, f"{path}-{r}.json").read_text()) for r in range(a.world)]
    full = QWEN25_05B.params(a.layers) * 4
    print(f"\nQwen2.5-0.5B shape, {a.layers} layers: fp32 weights {full / 2**30:.2f} GiB; {a.world} ranks on gloo")
    print(f"{'path':>6} {'rank':>5} {'peak above start GiB':>21} {'its shard GiB':>14} {'seconds':>8}")
    for r in rows:
        print(f"{r['path']:>6} {r['rank']:>5} {r['peak_above_start_bytes'] / 2**30:>21.2f} "
              f"{r['local_shard_bytes'] / 2**30:>14.2f} {r['seconds']:>8.1f}")
    by = {(r["path"], r["rank"]): r for r in rows}
    for rank in range(a.world):
        print(f"rank {rank}: every/lead peak {by[('every', rank)]['peak_above_start_bytes'] / by[('lead', rank)]['peak_above_start_bytes']:.2f}x")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank_load.json").write_text(json.dumps({"world": a.world, "layers": a.layers, "weights_bytes": full,
                                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
