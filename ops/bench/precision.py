"""bf16 against fp32 on this CPU: the probe `precision.auto` decides by, the learner's pass, and generation.

What `model.dtype="auto"` / `learner.mixed_precision="auto"` choose between (exgrpo_async/precision.py),
measured on one core with one torch thread (run it under `taskset -c 1`):
- probe: `precision.probe_bf16_ratio()`, the ratio the launcher compares with `PROBE_RATIO`;
- learner pass: forward with log-probs and backward over 160 toy-shaped sequences (ops/bench/learner_pass.py's
  workload, shortest first, 64 per micro-batch), fp32 against bf16 autocast, alternating pass by pass;
- generation: two vLLM engines of the cached toy policy in this process (the actor's engine config),
  one float32 and one bfloat16, called in turn on the same stream of 16 training questions x K=8 at
  T=1, 64 new tokens (the demo's request); microseconds per generated token.
Medians over --reps alternations; prints a table of bf16 / fp32 and writes JSON.

    taskset -c 1 .venv/bin/python ops/bench/precision.py [--reps 9] [--out bench_out/precision.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_pass import one_pass, sequences  # noqa: E402

from actors.engine import VLLMEngine  # noqa: E402
from exgrpo_async import precision  # noqa: E402
from exgrpo_async.config import RunConfig  # noqa: E402
from exgrpo_async.toy.task import build_model, ensure_toy_assets  # noqa: E402

Q, K, MAX_TOKENS = 16, 8, 64


def learner_pass(reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model(0)
    prompts, comps = sequences(160)
    order = sorted(range(160), key=lambda i: (len(prompts[i]) + len(comps[i]), i))
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for i in range(2 * reps + 2):
        arm = ("fp32", "bf16")[i % 2]
        t = one_pass(model, prompts, comps, order, 64, None, bf16=arm == "bf16")[0]
        if i >= 2:
            times[arm].append(t)
    return {arm: statistics.median(v) for arm, v in times.items()}


def generation(reps: int) -> dict[str, float]:
    cfg = RunConfig()
    assets = ensure_toy_assets(Path(cfg.toy.cache_dir).expanduser(), cfg.toy.seed, cfg.toy.sft_steps)
    engines = {}
    for arm, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        model_cfg = cfg.model.model_copy(update={"dtype": dtype})
        engines[arm] = VLLMEngine(str(assets["model"]), model_cfg, cfg.actor.engine, on_cpu=True, seed=1)
    rows = [json.loads(x) for x in Path(assets["train"]).read_text().splitlines()]
    prompts = [r["problem"] for r in rows[:(reps + 1) * Q]]
    per_token: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for i in range(reps + 1):
        batch = prompts[i * Q:(i + 1) * Q]
        for arm in (("fp32", "bf16") if i % 2 else ("bf16", "fp32")):
            t0 = time.perf_counter()
            outs = engines[arm].generate(batch, K, 1.0, MAX_TOKENS)
            seconds = time.perf_counter() - t0
            if i:  # the first round warms up
                per_token[arm].append(seconds / sum(len(s.token_ids) for _, ss in outs for s in ss) * 1e6)
    return {arm: statistics.median(v) for arm, v in per_token.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="bench_out/precision.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    probe = precision.probe_bf16_ratio()
    passes = learner_pass(a.reps)
    gen = generation(a.reps)
    print(f"one thread; medians of {a.reps} alternations")
    print(f"{'measure':52s} {'fp32':>9s} {'bf16':>9s} {'bf16/fp32':>10s}")
    print(f"{'probe (the launcher decides bf16 at <= ' + format(precision.PROBE_RATIO, '.0%') + ')':52s} "
          f"{'':>9s} {'':>9s} {probe:10.0%}")
    print(f"{'learner pass, s (160 sequences)':52s} {passes['fp32']:9.3f} {passes['bf16']:9.3f} "
          f"{passes['bf16'] / passes['fp32']:10.0%}")
    print(f"{'generation, us per token (16 questions x 8)':52s} {gen['fp32']:9.1f} {gen['bf16']:9.1f} "
          f"{gen['bf16'] / gen['fp32']:10.0%}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "probe_ratio": probe, "learner_pass_s": passes,
                                       "generation_us_per_token": gen}, indent=1))


if __name__ == "__main__":
    main()
