"""Why a run's learner idles what it does, from its metrics.jsonl: the work of the two sides per step.

With both sides on the same fully busy cores (the CPU demo), a step of T seconds holds the learner's
compute L (the step minus its wait) and everything else G (actors, verifier, server: the cores' busy
core-seconds minus L), so the learner waits T - L and its idle share is (G - L) / (G + L) when the
cores are full. This prints, per run: T, L, G, G / L, that predicted share and the measured one
(wait / step), over the steps after the first `--skip` (start-up); and what the rollouts' age costs:
the mean staleness (versions) and the median over steps of the step's largest importance weight.
Reads finished runs; runs nothing.

    .venv/bin/python ops/bench/system/balance.py bench_out/peer-expiring/ours-s*/run-* [--cores 2] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402


def work_split(rows: list[dict], cores: int, skip: int = 5) -> dict:
    """T, L, G (seconds or core-seconds per step), G / L, and the learner's predicted and measured idle."""
    rows = rows[skip:]
    steps, waits = sum(r["step_seconds"] for r in rows), sum(r["wait_seconds"] for r in rows)
    busy = statistics.median(r["cores_busy_frac"] for r in rows)
    T, L = steps / len(rows), (steps - waits) / len(rows)
    G = cores * busy * T - L
    return {"step_s": T, "learner_s": L, "rest_core_s": G, "rest_over_learner": G / L, "cores_busy": busy,
            "idle_predicted": (G - L) / (G + L), "idle_measured": waits / steps}


def staleness(rows: list[dict], skip: int = 5) -> dict:
    """Mean staleness of the trained groups (versions) and the median over steps of each step's largest
    importance weight, over the steps after the first `skip`."""
    rows = rows[skip:]
    return {"staleness_mean": statistics.mean(r["staleness_mean"] for r in rows),
            "is_weight_max_median": statistics.median(r["is_weight_max"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl)")
    ap.add_argument("--cores", type=int, default=2, help="cores the run's processes shared")
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {}
    print("| run | step s | learner s (L) | rest, core-s (G) | G / L | cores busy | idle predicted | idle measured "
          "| staleness | IS weight max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in a.runs:
        rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x]
        r = res[run] = {**work_split(rows, a.cores, a.skip), **staleness(rows, a.skip)}
        print(f"| {run} | {r['step_s']:.3f} | {r['learner_s']:.3f} | {r['rest_core_s']:.3f} | "
              f"{r['rest_over_learner']:.2f} | {r['cores_busy']:.0%} | {r['idle_predicted']:.1%} | "
              f"{r['idle_measured']:.1%} | {r['staleness_mean']:.2f} | {r['is_weight_max_median']:.2f} |")
    if a.out:
        bench.write_json(a.out, res, indent=1)


if __name__ == "__main__":
    main()
