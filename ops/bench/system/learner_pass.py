"""One learner pass (forward with log-probs, backward) on the toy model's shape, laid out several ways.

The demo's step is forward plus backward over a step's sequences (docs/benchmarks.md). This isolates
that pass on one thread, with synthetic sequences shaped like the toy task's (prompts of 9-21 tokens,
completions of 10-40 tokens or truncated at 64), and compares the layouts the learner can use:
micro-batches in arrival order or cut shortest first (learner/maths/update.py `cut_micro_batches`), the output head in
512-position chunks or one chunk (`learner.maths.grpo.logit_chunk`), packed rows (max_tokens_per_micro_batch),
bf16 autocast, and the micro-batches `learner.overlap_arrival` cuts as groups arrive (arrival order,
5 forwarded sequences a group). Medians over --reps passes.

    taskset -c 1 .venv/bin/python ops/bench/system/learner_pass.py [--seqs 160] [--reps 5] [--out bench_out/learner_pass.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from exgrpo_async.toy.task import build_model
from learner.maths.grpo import token_logprobs
from learner.maths.packing import layout, micro_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402


def sequences(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randint(8, 20))] for _ in range(n)]
    comps = [[rng.randrange(3, 100) for _ in range(rng.choice([rng.randint(10, 40), 64]))] for _ in range(n)]
    return prompts, comps


def streamed(lengths: list[int], arrival: list[int], per_micro: int, group: int = 5) -> list[list[int]]:
    """The micro-batches `learner.overlap_arrival` cuts (learner/overlap.py): sequences arriving `group`
    at a time (a group's forwarded ones), each full micro-batch of the shortest pending run at once."""
    def cut(idx):
        idx = sorted(idx, key=lambda i: (lengths[i], i))
        return [[idx[k] for k in part] for part in micro_batches([lengths[i] for i in idx], per_micro, None)]
    parts, pending = [], []
    for g in range(0, len(arrival), group):
        cuts = cut(pending + arrival[g:g + group])
        parts, pending = parts + cuts[:-1], cuts[-1]
    return parts + cut(pending)


def one_pass(model, prompts, comps, order, per_micro, chunk, bf16=False, budget=None) -> tuple[float, int]:
    """`order` cut `per_micro` at a time, or, given as a list of micro-batches, those."""
    t0, padded = time.perf_counter(), 0
    parts = order if isinstance(order[0], list) else [order[s:s + per_micro] for s in range(0, len(order), per_micro)]
    for idx in parts:
        rows = layout([prompts[i] for i in idx], [comps[i] for i in idx], 0, budget)
        padded += rows.input_ids.numel()
        lp = token_logprobs(model, rows.input_ids, rows.attention_mask, chunk_tokens=chunk, bf16=bf16,
                            position_ids=rows.position_ids)
        (lp * rows.target_mask).sum().backward()
    return time.perf_counter() - t0, padded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=160, help="forwarded sequences of one step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    bench.add_out(ap, "learner_pass.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_model(0)
    prompts, comps = sequences(a.seqs)
    arrival = list(range(a.seqs))
    shortest_first = sorted(arrival, key=lambda i: (len(prompts[i]) + len(comps[i]), i))
    as_streamed = streamed([len(p) + len(c) for p, c in zip(prompts, comps)], arrival, 64)
    arms = {
        "arrival order, 64/micro, 512-position chunks (before)": (arrival, 64, 512, False, None),
        "arrival order, 64/micro, one chunk": (arrival, 64, None, False, None),
        "shortest first, 64/micro, one chunk (now)": (shortest_first, 64, None, False, None),
        "shortest first, 32/micro, one chunk": (shortest_first, 32, None, False, None),
        "shortest first, 16/micro, one chunk": (shortest_first, 16, None, False, None),
        "packed rows of 2048 tokens, one chunk": (arrival, a.seqs, None, False, 2048),
        "shortest first, 64/micro, one chunk, bf16 autocast": (shortest_first, 64, None, True, None),
        "shortest first, 32/micro, one chunk, bf16 autocast": (shortest_first, 32, None, True, None),
        "shortest first, 16/micro, one chunk, bf16 autocast": (shortest_first, 16, None, True, None),
        "as streamed (overlap_arrival), 64/micro, one chunk, bf16": (as_streamed, 64, None, True, None),
    }
    real = sum(len(p) + len(c) for p, c in zip(prompts, comps))
    rows = []
    print(f"{a.seqs} sequences, {real} tokens, {a.threads} thread(s); median of {a.reps} passes")
    print(f"{'layout':54s} {'s/pass':>8s} {'tokens in':>10s} {'vs before':>10s}")
    for name, (order, per, chunk, bf16, budget) in arms.items():
        one_pass(model, prompts, comps, order, per, chunk, bf16, budget)  # warm-up
        times = []
        for _ in range(a.reps):
            t, padded = one_pass(model, prompts, comps, order, per, chunk, bf16, budget)
            times.append(t)
        rows.append({"layout": name, "seconds": statistics.median(times), "tokens": padded})
        print(f"{name:54s} {rows[-1]['seconds']:8.3f} {padded:10d} {rows[-1]['seconds'] / rows[0]['seconds']:9.0%}",
              flush=True)
    bench.write_json(a.out, {"args": vars(a), "real_tokens": real, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
