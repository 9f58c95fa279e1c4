"""Pipeline: synchronous (eta=0) against asynchronous (eta=1, 2, 4) training of the same config.

Each run is a real `exgrpo-async train` (one learner, `--actors` vLLM actors, each actor pinned to its
core by the launcher, the learner on 1 thread) on the cached toy policy, with held-out evaluation off
so the clock covers RL only. Per run, from metrics.jsonl, steps after the first `--skip` (warm-up):
- rollouts/s: rollouts trained / wall seconds between the end of step `skip` and the last step;
- learner idle %: time the learner waited for rollouts / step time;
- actor idle %: 1 - (seconds the actors spent generating) / (seconds elapsed), over the measured steps
  (from the per-step `actor_idle_frac`, weighted by step time);
- reward: mean batch reward of the last 10 steps; staleness: mean over the measured steps;
- update stall (stream engine): seconds the engine was paused per in-flight weight update, mean/max.
Ideal overlap bound, from the eta=0 run of the same invocation: per step, gen = the learner's wait for
the batch (nothing else runs then) and train = the rest of the step (update + publish); a perfect
pipeline overlaps them: speedup (gen + train) / max(gen, train). Target: eta=1 speedup >= 90% of it.
`--rounds N` runs the etas in turn N times and reports each figure's median (the bound from the median
synchronous run), plus eta=1 against its own round's bound: this VM's speed drifts between runs.

    .venv/bin/python ops/bench/pipeline.py [--steps 30] [--etas 0,1,2,4] [--engine batch|stream] [--rounds 1]
        [--out bench_out/pipeline.json] [extra dotted overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = 0.9


def run_once(eta: int, steps: int, engine: str, actors: int, extra: list[str], out_dir: Path) -> list[dict]:
    args = [sys.executable, "-m", "exgrpo_async.cli", "train", f"learner.max_staleness={eta}",
            f"learner.max_steps={steps}", f"actor.engine.kind={engine}", f"actor.num_actors={actors}",
            "data.eval_file=none", f"output_dir={out_dir}", "metrics.port=none", *extra]
    t0 = time.time()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"eta={eta} run failed:\n{proc.stderr[-3000:]}")
    (run_dir,) = list(out_dir.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"  eta={eta} {engine}: {len(rows)} steps in {time.time() - t0:.0f}s", flush=True)
    return [r for r in rows if "reward_mean" in r]


def actor_idle_pct(rows: list[dict]) -> float | None:
    """Step-time-weighted mean of the per-step actor idle share (each step's figure spans that step)."""
    known = [r for r in rows if r.get("actor_idle_frac") is not None]
    if not known:
        return None
    return 100 * sum(r["actor_idle_frac"] * r["step_seconds"] for r in known) / sum(r["step_seconds"] for r in known)


def summarize(rows: list[dict], skip: int) -> dict:
    meas = rows[skip:]
    wall = sum(r["step_seconds"] for r in meas)  # steps are back to back: their sum is the wall clock
    stalls = [r["update_stall_seconds"] for r in meas if r.get("update_stall_seconds") is not None]
    stall_max = [r["update_stall_max_seconds"] for r in meas if r.get("update_stall_max_seconds") is not None]
    return {
        "rollouts_per_s": sum(r["rollouts"] for r in meas) / wall,
        "learner_idle_pct": 100 * sum(r["wait_seconds"] for r in meas) / wall,
        "actor_idle_pct": actor_idle_pct(meas),
        "reward_last10": statistics.mean(r["reward_mean"] for r in rows[-10:]),
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in meas),
        "gen_seconds_per_step": statistics.mean(r["wait_seconds"] for r in meas),
        "train_seconds_per_step": statistics.mean(r["step_seconds"] - r["wait_seconds"] for r in meas),
        "sync_seconds_mean": statistics.mean(r["sync_seconds"] for r in meas),
        "update_stall_mean": statistics.mean(stalls) if stalls else None,
        "update_stall_max": max(stall_max) if stall_max else None,
    }


def ideal_speedup(sync: dict) -> float:
    """The overlap bound (gen + train) / max(gen, train) from a synchronous run's summary."""
    gen, train = sync["gen_seconds_per_step"], sync["train_seconds_per_step"]
    return (gen + train) / max(gen, train)


def median_summary(runs: list[dict]) -> dict:
    """Field by field median of one eta's summaries (None where a run has none)."""
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--etas", default="0,1,2,4")
    ap.add_argument("--engine", default="batch", choices=["batch", "stream"])
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="run the etas in turn this many times; report medians")
    ap.add_argument("--out", default=str(REPO / "bench_out" / "pipeline.json"))
    ap.add_argument("overrides", nargs="*", help="extra dotted config overrides for every run")
    args = ap.parse_args()
    etas = [int(x) for x in args.etas.split(",")]
    if 0 not in etas:
        raise SystemExit("--etas must include 0: it is the synchronous baseline")
    rounds: list[dict[int, dict]] = []  # the etas run in turn, `--rounds` times: the VM's drift hits all alike
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            rounds.append({eta: summarize(run_once(eta, args.steps, args.engine, args.actors, args.overrides,
                                                   Path(tmp) / f"r{k}eta{eta}"), args.skip) for eta in etas})
    results = {eta: median_summary([r[eta] for r in rounds]) for eta in etas}
    base = results[0]
    gen, train = base["gen_seconds_per_step"], base["train_seconds_per_step"]
    ideal = ideal_speedup(base)
    print(f"\npipeline, engine={args.engine}, {args.actors} actor(s), {args.steps} steps (first {args.skip} not timed), "
          f"{os.cpu_count()} CPUs, median of {args.rounds} round(s)")
    print(f"eta=0 per step: gen {gen:.3f}s  train {train:.3f}s  -> ideal overlap speedup {ideal:.2f}x")
    head = f"{'eta':>3} {'rollouts/s':>10} {'speedup':>8} {'of ideal':>8} {'learner idle':>12} {'actor idle':>10} " \
           f"{'reward':>7} {'stale':>6} {'stall mean/max (s)':>19}"
    print(head)
    for eta, r in results.items():
        r["speedup"] = r["rollouts_per_s"] / base["rollouts_per_s"]
        r["of_ideal"] = r["speedup"] / ideal
        stall = (f"{r['update_stall_mean']:.4f}/{r['update_stall_max']:.4f}" if r["update_stall_mean"] is not None else "-")
        actor_idle = f"{r['actor_idle_pct']:.1f}%" if r["actor_idle_pct"] is not None else "-"
        print(f"{eta:>3} {r['rollouts_per_s']:>10.1f} {r['speedup']:>7.2f}x {100 * r['of_ideal']:>7.1f}% "
              f"{r['learner_idle_pct']:>11.1f}% {actor_idle:>10} {r['reward_last10']:>7.3f} {r['staleness_mean']:>6.2f} "
              f"{stall:>19}")
    if args.rounds > 1 and 1 in results:  # each round judged against its own synchronous run
        per_round = [r[1]["rollouts_per_s"] / r[0]["rollouts_per_s"] / ideal_speedup(r[0]) for r in rounds]
        results[1]["of_ideal_per_round"] = per_round
        print("eta=1 of ideal, round by round: " + ", ".join(f"{100 * x:.1f}%" for x in per_round))
    ok = 1 in results and results[1]["of_ideal"] >= TARGET
    print(f"target: eta=1 >= {TARGET:.0%} of the ideal bound: {'met' if ok else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"engine": args.engine, "actors": args.actors, "steps": args.steps, "rounds": args.rounds,
                               "ideal_speedup": ideal,
                               "results": results, "target_of_ideal": TARGET, "pass": ok}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
