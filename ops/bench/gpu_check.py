"""GPU check: one learner at the Qwen2.5-Math-1.5B shape, as the 8-GPU config trains it, on one GPU.

Random weights from the config (no hub), FSDP2 over a world of 1 (NCCL), fp32 master weights and AdamW,
bf16 compute (FSDP2's MixedPrecisionPolicy), gradient checkpointing, sequences packed under the token
budget, the learner's own `update_policy` (loss, IS correction, entropy bonus). Prints peak GPU memory,
tokens/s and model FLOPs utilisation (6 x non-embedding parameters + the head + attention, per token,
against the GPU's dense bf16 peak), and the share of master weights one step at lr 1e-6 moved (fp32
master weights: ~100%; bf16 weights would keep ~2%). Then the placement and weight-sync checks of
ops/bench/gpu_sync_check.py on the same model: the planner against the real device list, the publisher
packing the model into bf16 buckets, a broadcast into a ring-buffer receiver, a frozen receiver's
timeout. Writes JSON.

    ops/gpu-check                 # on a machine with a GPU (python ops/bench/gpu_check.py)
    .venv/bin/python ops/bench/gpu_check.py --device cpu --layers 2 --steps 1 --tokens-per-step 2048 \
        --budget 1024   # the same code path on CPU (gloo), a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's 28)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=16384, help="learner.max_tokens_per_micro_batch")
    ap.add_argument("--bucket-mb", type=int, default=256, help="weight_sync.bucket_mb for the sync checks")
    ap.add_argument("--out", default="bench_out/gpu_check.json")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM

    from exgrpo_async.config import RunConfig
    from learner.memory_model import QWEN25_15B, qwen2_config, rank_bytes
    from learner.policy import shard
    from learner.ranks import Ranks
    from learner.update import Seq, StepSettings, update_policy

    cuda = a.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    s = QWEN25_15B
    layers = a.layers or s.layers
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(s, layers, max_positions=a.seq_len))  # fp32 master weights
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forward = shard(model, "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0)
    cfg = RunConfig()
    L = cfg.learner
    L.mixed_precision, L.max_tokens_per_micro_batch, L.lr, L.entropy_coef = "bf16", a.budget, 1e-6, 3e-4
    L.grad_clip, L.skip_grad_norm = 1.0, 1e12
    cfg.rollout.max_new_tokens = a.seq_len
    rng = random.Random(0)
    n_seqs = a.tokens_per_step // a.seq_len
    K = 8
    prompt_len = 256

    def batch() -> list[Seq]:
        out = []
        for i in range(n_seqs):
            comp = [rng.randrange(3, s.vocab) for _ in range(a.seq_len - prompt_len)]
            out.append(Seq([rng.randrange(3, s.vocab) for _ in range(prompt_len)], comp,
                           torch.full((len(comp),), -2.0), rng.choice([-0.5, 0.5]), 0, i // K, False, False))
        return out

    params = sum(p.numel() for p in model.parameters())
    non_embed = params - s.vocab * s.hidden * (1 if s.tied else 2)
    # per token: 6 x (matmul parameters + the head) + causal attention (6 x 2 x layers x T/2 x h)
    flops_per_token = 6 * (non_embed + s.vocab * s.hidden) + 6 * layers * a.seq_len * s.hidden
    update_policy(forward, opt, batch(), max(1, n_seqs // K), cfg, StepSettings(clip=0.2), device, 0, 0, Ranks(0, 1, device))
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for k in range(a.steps):
        update_policy(forward, opt, batch(), max(1, n_seqs // K), cfg, StepSettings(clip=0.2), device, 0, k + 1,
                      Ranks(0, 1, device))
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / a.steps
    # forward + backward + the checkpointed recompute: the MFU counts the model's 6 x FLOPs only
    tok_s = n_seqs * a.seq_len / seconds
    moved = sum(int((p.detach().full_tensor() != before[n]).sum()) for n, p in model.named_parameters())
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu), None)
    res = {"device": gpu, "shape": s.name, "layers": layers, "params": params, "tokens_per_step": n_seqs * a.seq_len,
           "budget": a.budget, "seconds_per_step": seconds, "tokens_per_s": tok_s,
           "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
           "memory_model_bytes": rank_bytes(s, a.budget, 1) if layers == s.layers else None,
           "mfu": tok_s * flops_per_token / peak_flops if peak_flops else None,
           "master_weights_moved_frac": moved / params}
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_sync_check import planner_results, sync_results

    res["placement"] = planner_results(torch.cuda.device_count() if cuda else 0)
    res["weight_sync"] = sync_results(model, device, a.bucket_mb)
    for k, v in res.items():
        if isinstance(v, dict):
            print(k)
            for kk, vv in v.items():
                print(f"  {kk:40s} {vv}")
        else:
            print(f"{k:28s} {v}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
