"""The demo over seeds: `./ops/demo` as a new user runs it, once per seed S with the learner's seed and the
training questions' order both S (`learner.seed=S data.shuffle_seed=S`; the shipped seed is 0), and each
run's held-out gain with the standard error of that paired difference (summary.json's `gain`), its
whole wall time, and the mean and spread of the gains over the seeds.

    .venv/bin/python ops/bench/learning/demo_seeds.py --seeds 0,1,2,3,4 [--out bench_out] [extra dotted overrides...]
    ops/avx2 .venv/bin/python ops/bench/learning/demo_seeds.py --seeds 0 --tag avx2     # as an AVX2-only CPU runs it
    .venv/bin/python ops/bench/learning/demo_seeds.py --report bench_out/demo-seeds.json [more.json ...]

Writes `--out/demo-seeds[-TAG].json` (each run's summary figures and the CPU's model name and flags) and
prints a table; `--report` prints the table of saved files again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402


def cpu() -> dict:
    """The CPU's model name, its vector flags, and the caps, core speed and measured pace ops/avx2 sets (if any)."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    caps = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                       "EXGRPO_CPU_SPEED", "EXGRPO_CPU_PACE") if k in os.environ}
    return {"model": model, "flags": sorted(f for f in flags if f.startswith(("avx", "amx"))), "caps": caps}


def run_seed(seed: int, out: Path, extra: list[str]) -> dict:
    """One `./ops/demo` with this seed; its summary's figures and the whole wall time."""
    folder = out / f"seed-{seed}"
    t0 = time.time()
    proc = subprocess.run([str(REPO / "ops" / "demo"), f"learner.seed={seed}", f"data.shuffle_seed={seed}",
                           f"output_dir={folder}", *extra], cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}: ./ops/demo exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    run_dir = max(folder.glob("run-*"), key=lambda p: p.stat().st_mtime)
    s = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "run_dir": str(run_dir), "wall_s": wall, "rl_s": s["rl_seconds"], "steps": s["steps"],
            "before": s["before"]["accuracy"], "after": s["after"]["accuracy"],
            "greedy_before": s["before"]["greedy_accuracy"], "greedy_after": s["after"]["greedy_accuracy"],
            "gain": s["gain"], "eval_s": [s["before"]["seconds"], s["after"]["seconds"]],
            "learner_idle": s.get("learner_idle_median"), "actor_idle": s.get("actor_idle_median")}


def table(runs: list[dict]) -> list[str]:
    """One row per run, then the gains' mean, standard deviation and range over the runs."""
    lines = ["| seed | sampled before -> after | gain ± paired SE | gain / SE | greedy gain ± SE | wall s | RL s |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        g = r["gain"]
        lines.append(f"| {r['seed']} | {r['before']:.3f} -> {r['after']:.3f} | {100 * g['sampled']:+.1f} ± "
                     f"{100 * g['sampled_se']:.1f} | {g['sampled'] / g['sampled_se']:.1f} | {100 * g['greedy']:+.1f} ± "
                     f"{100 * g['greedy_se']:.1f} | {r['wall_s']:.0f} | {r['rl_s']:.0f} |")
    gains = [100 * r["gain"]["sampled"] for r in runs]
    if len(gains) > 1:
        lines.append(f"\ngain over {len(gains)} seeds: {statistics.mean(gains):+.1f} ± {statistics.stdev(gains):.1f} "
                     f"points (mean ± std; {min(gains):+.1f} .. {max(gains):+.1f}); median wall "
                     f"{statistics.median(r['wall_s'] for r in runs):.0f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0, the shipped one)")
    bench.add_out(ap, "", help="folder for the runs and the JSON")
    ap.add_argument("--tag", default="", help="suffix of the JSON's name (e.g. the CPU class)")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the table of saved files instead")
    args, extra = ap.parse_known_args(argv)
    if args.report:
        runs = [r for f in args.report for r in json.loads(Path(f).read_text())["runs"]]
        print("\n".join(table(runs)))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"demo-seeds{'-' + args.tag if args.tag else ''}.json"
    result = {"cpu": cpu(), "overrides": extra, "runs": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        result["runs"].append(run_seed(seed, out / (args.tag or "demo-seeds"), extra))
        bench.write_json(path, result, say=False)  # after each seed: a stopped bench keeps what it ran
        print("\n".join(table(result["runs"])[-1:]), flush=True)
    print(f"CPU: {result['cpu']['model']}; {' '.join(result['cpu']['flags'])}; caps {result['cpu']['caps']}")
    print("\n".join(table(result["runs"])))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
