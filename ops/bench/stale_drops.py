"""Stale drops with and without `learner.wait_for_expiring`, on an idle or a loaded machine.

With two actors, one can finish the next step's work before the other finishes this step's. Trained in
arrival order, the slower actor's groups then come a step too late and are dropped as staler than eta
and generated again. `learner.wait_for_expiring` (learner/inbox.py) takes first the groups that cannot
wait a step and holds newer ones back (at most a step's time) while such groups are still being made.
This runs the demo (`exgrpo-async train` on its embedded defaults, with eta pinned to 1, the default
when the figures in docs/benchmarks.md were taken) for `--steps` steps per seed and arm, seeds
outermost, optionally beside `--load` busy processes (a machine shared with other work, where actors
run at uneven speeds), and reads each run's metrics: groups dropped, steps where a group generated on
the learner's current weights was trained (a newer group overtook: lag 0 at eta=1), wall time of the
steps, learner idle. Prints a table and writes OUT/stale_drops.json.

    .venv/bin/python ops/bench/stale_drops.py [--seeds 0,1,2] [--steps 100] [--load 1] [--out bench_out/stale]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARMS = {"wait_for_expiring": "learner.wait_for_expiring=true", "arrival order": "learner.wait_for_expiring=false"}


def spin() -> None:
    while True:
        pass


def run(out: Path, seed: int, steps: int, override: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    with open(out.with_suffix(".log"), "w") as f:
        cmd = [sys.executable, "-m", "exgrpo_async.launcher.cli", "train", f"output_dir={out}", f"learner.max_steps={steps}",
               f"learner.seed={seed}", "metrics.port=none", "learner.max_staleness=1", override]
        if subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"failed: {' '.join(cmd)} (log: {out.with_suffix('.log')})")
    (run_dir,) = out.glob("run-*")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"stale_dropped": summary["stale_dropped"], "step_seconds": sum(r["step_seconds"] for r in rows),
            "overtaken_steps": sum(1 for r in rows[1:] if "0" in (r["staleness_hist"] or {})),
            "learner_idle_median": summary["learner_idle_median"], "tokens_generated": summary["tokens_generated"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--load", type=int, default=0, help="busy processes beside each run (a loaded machine)")
    ap.add_argument("--out", default="bench_out/stale")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed in (int(s) for s in a.seeds.split(",")):
        for arm, override in ARMS.items():
            hogs = [mp.Process(target=spin, daemon=True) for _ in range(a.load)]
            for h in hogs:
                h.start()
            try:
                r = run(out / f"{arm.replace(' ', '_')}-s{seed}", seed, a.steps, override)
            finally:
                for h in hogs:
                    h.terminate()
            res[arm].append(r)
            print(arm, seed, json.dumps(r), flush=True)
    med = statistics.median
    print(f"\n{a.steps} steps, {a.load} busy process(es) beside each run; per seed, then the median\n")
    print("| arm | groups dropped | steps with an overtaking group | steps' wall s | learner idle |")
    print("|---|---|---|---|---|")
    for arm, runs in res.items():
        def col(k: str, f: str) -> str:  # per seed, then the median
            return ", ".join(f.format(r[k]) for r in runs) + f" ({f.format(med(r[k] for r in runs))})"
        print(f"| {arm} | {col('stale_dropped', '{}')} | {col('overtaken_steps', '{}')} | "
              f"{col('step_seconds', '{:.1f}')} | {col('learner_idle_median', '{:.0%}')} |")
    (out / "stale_drops.json").write_text(json.dumps({"steps": a.steps, "load": a.load, "runs": res}, indent=1))


if __name__ == "__main__":
    main()
