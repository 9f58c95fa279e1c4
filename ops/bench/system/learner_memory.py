"""Learner memory: peak memory and tokens/s of one learner step against tokens per micro-batch.

At the shape of Qwen2.5-0.5B (width 896, MLP 4864, 14/2 heads, vocabulary 151,936, tied), built from a
config with random weights (no hub), `--layers` of its 24 layers (24 does not fit this 24 GB machine on
the old path at 4096 tokens; the memory model in learner/maths/memory_model.py scales by layers). One row of T
tokens (prompt 64 + completion), fp32, AdamW, on this CPU. Two paths side by side:
- old: the learner before issue 15: the model's full-vocabulary fp32 logits for the whole micro-batch,
  log-softmax and entropy over them, every layer's activations kept for backward;
- new: today's `token_logprobs` (the head 512 positions at a time, each chunk checkpointed) with
  transformers' gradient checkpointing on every decoder layer.
Each (path, T) runs in a fresh process: a 64-token warm-up step allocates gradients and AdamW state,
then the peak resident memory is reset (/proc/self/clear_refs) and one step at T tokens is measured:
"step peak" is the peak RSS of that step above the RSS before it (master weights and AdamW state
excluded: they do not depend on T; the step's gradients are included). The memory model's prediction
of the same quantity sits beside each measurement.

    .venv/bin/python ops/bench/system/learner_memory.py [--tokens 1024,2048,4096] [--layers 4] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from learner.maths.memory_model import QWEN25_05B, qwen2_config, step_peak_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(path: str, tokens: int, layers: int, threads: int) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    from learner.maths.grpo import logp_entropy, token_logprobs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    s = QWEN25_05B
    model = Qwen2ForCausalLM(qwen2_config(s, layers))
    if path == "new":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(t: int) -> float:
        ids = torch.randint(3, s.vocab, (1, t))
        mask = torch.zeros(1, t - 1, dtype=torch.bool)
        mask[:, 63:] = True  # a 64-token prompt, the rest completion
        t0 = time.perf_counter()
        if path == "old":
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
            logp, ent = logp_entropy(logits, ids[:, 1:], None, None, 1.0, True)
        else:
            logp, ent = token_logprobs(model, ids, torch.ones_like(ids), 1.0, with_entropy=True)
        loss = -((logp + 3e-4 * ent) * mask).sum() / (t * 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(64)  # AdamW state exists from here on
    del_refs = Path("/proc/self/clear_refs")
    del_refs.write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _rss("VmRSS")
    seconds = step(tokens)
    peak = _rss("VmHWM") - base
    print(json.dumps({"path": path, "tokens": tokens, "layers": layers, "step_peak_bytes": peak, "seconds": seconds,
                      "tokens_per_s": tokens / seconds, "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="old,new")
    bench.add_out(ap, "", help="folder for learner_memory.json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], int(a.child[1]), a.layers, a.threads)
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        for path in a.paths.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", path, str(t), "--layers", str(a.layers),
                                   "--threads", str(a.threads)], capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                raise RuntimeError(f"{path} at {t} tokens failed:\n{proc.stderr[-2000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["model_bytes"] = step_peak_bytes(QWEN25_05B, t, a.layers, path=path)
            rows.append(r)
            print(f"  {path} {t}: {r['step_peak_bytes'] / 2**30:.2f} GiB, {r['tokens_per_s']:.0f} tok/s", flush=True)
    print(f"\nQwen2.5-0.5B shape, {a.layers} layers, one row, fp32, AdamW, {a.threads} threads")
    print(f"{'tokens':>7} {'path':>5} {'step peak GiB':>14} {'per token KiB':>14} {'model GiB':>10} "
          f"{'model/meas':>10} {'tok/s':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['path']:>5} {r['step_peak_bytes'] / 2**30:>14.2f} "
              f"{r['step_peak_bytes'] / r['tokens'] / 1024:>14.0f} {r['model_bytes'] / 2**30:>10.2f} "
              f"{r['model_bytes'] / r['step_peak_bytes']:>10.2f} {r['tokens_per_s']:>7.0f}")
    by = {(r["path"], r["tokens"]): r for r in rows}
    for t in sorted({r["tokens"] for r in rows}):
        if ("old", t) in by and ("new", t) in by:
            o, n = by[("old", t)], by[("new", t)]
            print(f"{t} tokens: old/new step peak {o['step_peak_bytes'] / n['step_peak_bytes']:.1f}x, "
                  f"new/old tokens/s {n['tokens_per_s'] / o['tokens_per_s']:.2f}x")
    bench.write_json(Path(a.out) / "learner_memory.json", {"layers": a.layers, "threads": a.threads, "rows": rows},
                     indent=1)


if __name__ == "__main__":
    main()
