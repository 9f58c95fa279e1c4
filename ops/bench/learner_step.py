"""Where the learner's step goes: the demo (plain GRPO) against the demo with ExGRPO, side by side.

Each arm is a real `exgrpo-async train` on the demo's embedded defaults (2 vLLM actors, a 1-thread learner,
the cached toy warm start), held-out evaluation off. From metrics.jsonl, the median seconds per step of:
wait (for rollouts), recompute (no-grad pre-update log-probs of the later mini-batches), forward (with
the loss), backward, optimizer, exgrpo (step-end bookkeeping with the selection forward), publish, the
whole step; the learner's and the actors' idle shares; and `steady`, the counted steps' seconds summed
(the run's wall time without start-up and the first steps). Steps after the first `--skip`; the ExGRPO arm
counts only steps whose batch mixed in replayed experience (after the delayed start). The last table
line is the ExGRPO step's learner time (step minus wait) over the GRPO step's: the issue's target is
1.2x at most.

    .venv/bin/python ops/bench/learner_step.py [--steps 40] [--skip 5] [--out bench_out/learner_step.json]
        [extra dotted overrides for both arms...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ["wait", "recompute", "forward", "backward", "optimizer", "exgrpo", "publish", "step"]
ARMS = {"grpo": [], "exgrpo": ["exgrpo.enabled=true"]}


def run_arm(name: str, steps: int, extra: list[str], out_dir: Path) -> tuple[list[dict], float]:
    args = [sys.executable, "-m", "exgrpo_async.launcher.cli", "train", f"learner.max_steps={steps}", "data.eval_file=none",
            "metrics.port=none", f"output_dir={out_dir / name}", *ARMS[name], *extra]
    t0 = time.time()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: train failed\n{proc.stderr[-3000:]}")
    (run_dir,) = list((out_dir / name).iterdir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in rows if "loss" in r], time.time() - t0


def summarize(rows: list[dict], skip: int, mixed_only: bool) -> dict:
    rows = [r for r in rows[skip:] if not mixed_only or r.get("exgrpo_mixed")]
    if not rows:
        return {"steps": 0}
    med = lambda k: statistics.median(float(r.get(k) or 0.0) for r in rows)  # noqa: E731
    out = {"steps": len(rows), **{p: med(f"{p}_seconds") for p in PHASES}}
    out["learner"] = statistics.median(r["step_seconds"] - r["wait_seconds"] for r in rows)
    out["steady"] = sum(r["step_seconds"] for r in rows)  # the counted steps end to end: start-up left out
    out["learner_idle"] = med("learner_idle_frac")
    out["actor_idle"] = statistics.median(r["actor_idle_frac"] for r in rows if r.get("actor_idle_frac") is not None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--out", default="bench_out/learner_step.json")
    a, extra = ap.parse_known_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARMS:
            rows, wall = run_arm(name, a.steps, extra, Path(tmp))
            res[name] = {**summarize(rows, a.skip, mixed_only=name == "exgrpo"), "wall_seconds": wall}
    g, x = res["grpo"], res["exgrpo"]
    print(f"{'median s/step':<16}{'GRPO':>10}{'ExGRPO':>10}")
    for k in PHASES + ["learner", "learner_idle", "actor_idle", "steady"]:
        print(f"{k:<16}{g.get(k, float('nan')):>10.3f}{x.get(k, float('nan')):>10.3f}")
    print(f"{'steps counted':<16}{g['steps']:>10}{x['steps']:>10}")
    if x["steps"]:
        res["exgrpo_over_grpo_learner"] = x["learner"] / g["learner"]
        print(f"ExGRPO / GRPO learner time per step: {res['exgrpo_over_grpo_learner']:.2f}x (target <= 1.2x)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "extra": extra, **res}, indent=1))


if __name__ == "__main__":
    main()
