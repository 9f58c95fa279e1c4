"""Time to accuracy against TRL: the demo and TRL's GRPOTrainer from one frozen warm start, over seeds.

The peer harness (../shared/tools/peer/trl_toy.py, its own venv: see its README) trains TRL on the
project's toy task and scores any saved policy with one evaluator (held-out avg@8 at T=1, and greedy).
This script runs, one at a time on an otherwise idle machine:
- ours: `exgrpo-async train` on its embedded defaults (the layout chosen from the machine) for
  `--steps` steps per seed (`learner.seed`), a checkpoint every `--every` steps; each checkpoint's
  policy is scored by the harness's evaluator, its time being the run's step seconds summed up to it
  (training from the first step on: the actors' start-up and the before-evaluation left out);
- exgrpo: the same with `exgrpo.enabled=true` (ExGRPO's experience replay on the demo's defaults);
- fp32: the same with the precision pinned to fp32 (`model.dtype=float32 learner.mixed_precision=none`;
  the defaults choose bf16 where the machine computes it fast, exgrpo_async/precision.py);
- overlap: the same with `learner.overlap_arrival=true` (the learner computes micro-batches as the
  step's groups arrive instead of waiting for the whole batch: learner/overlap.py);
- arrival: the same with `learner.wait_for_expiring=false` (each step trains groups in arrival order,
  so a slower actor's can arrive a step too late and be dropped: learner/inbox.py);
- eta1, eta2: the same with `learner.max_staleness` 1 or 2 (how many steps ahead admission hands out
  work, and how old a rollout may be; 2 is the default since the comparison in docs/benchmarks.md);
- TRL: the harness with `--generation transformers` (its faster variant on this machine; `--trl vllm`
  for vLLM colocate) for `--steps` steps per seed (`--seed`), scored by the same evaluator; its time is
  the harness's training seconds (set-up and evaluations left out).
It prints, per system, the medians over seeds of accuracy against seconds; our time to TRL's final
accuracy (the first checkpoint whose median reaches TRL's median final avg@8) over TRL's time; and, at
TRL's final step, our time over TRL's and our avg@8 minus TRL's seed by seed (no threshold to flip on
a shared plateau); writes OUT/peer.json.

    .venv/bin/python ops/bench/learning/peer.py [--seeds 0,1,2] [--steps 200] [--every 25] [--out bench_out/peer]
        [--peer-py bench_out/peer-venv/bin/python] [--harness ../shared/tools/peer/trl_toy.py] [overrides...]
    .venv/bin/python ops/bench/learning/peer.py --systems ours,exgrpo --out bench_out/peer-exgrpo
        # the demo (plain GRPO) against the demo with exgrpo.enabled=true, seeds interleaved
    .venv/bin/python ops/bench/learning/peer.py --systems trl --trl-seconds 160 --reuse bench_out/peer/peer.json \
        --out bench_out/peer-trl160   # TRL on a wall-clock budget against the same runs of ours
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402

HARNESS_SFT_KEY = 150.0  # the harness names the warm start by recipe_key(seed, --sft-seconds), default 150.0


def sh(args: list, log: Path) -> float:
    t0 = time.time()
    with open(log, "w") as f:
        if subprocess.run([str(a) for a in args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"failed: {' '.join(map(str, args))} (log: {log})")
    return time.time() - t0


def freeze(src_cache: Path, out: Path) -> Path:
    """Copy the demo's warm start into OUT/toycache, and name it as the harness looks it up too."""
    from exgrpo_async.toy.task import recipe_key

    key = f"toy-{recipe_key(0, 600)}"
    cache = out / "toycache"
    if not (cache / key / "done").exists():
        if not (src_cache / key / "done").exists():
            raise SystemExit(f"no warm start in {src_cache / key}: run `exgrpo-async train` once")
        shutil.copytree(src_cache / key, cache / key, dirs_exist_ok=True)
    alias = cache / f"toy-{recipe_key(0, HARNESS_SFT_KEY)}"
    if not alias.exists():
        alias.symlink_to(key)
    return cache


def evaluate(a, cache: Path, model: Path, log: Path) -> dict:
    sh([a.peer_py, a.harness, "--main", REPO, "--cache", cache, "--eval-only", model, *shlex.split(a.eval_args)], log)
    return json.loads(log.read_text().strip().splitlines()[-1])


def ours(a, cache: Path, seed: int, extra: list[str], name: str = "ours") -> list[dict]:
    """Accuracy of each checkpoint of one seed's run against its training seconds."""
    out = Path(a.out) / f"{name}-s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    sh([sys.executable, "-m", "exgrpo_async.launcher.cli", "train", f"toy.cache_dir={cache}", f"output_dir={out}",
        f"learner.max_steps={a.steps}", f"learner.seed={seed}", f"learner.checkpoint_every={a.every}",
        f"learner.keep_checkpoints={a.steps // a.every + 1}", "metrics.port=none", *extra], Path(a.out) / f"{name}-s{seed}.log")
    (run,) = out.glob("run-*")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    seconds = {r["step"]: s for r, s in zip(rows, _cumsum([r["step_seconds"] for r in rows]))}
    points = []
    for ck in sorted(run.glob("checkpoints/step-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(ck.name.split("-")[1])
        ev = evaluate(a, cache, ck / "model", Path(a.out) / f"{name}-s{seed}-eval{step}.log")
        points.append({"step": step, "seconds": seconds[step], "accuracy": ev["accuracy"],
                       "greedy_accuracy": ev["greedy_accuracy"]})
    summary = json.loads((run / "summary.json").read_text())
    points[-1]["rl_seconds"] = summary["rl_seconds"]
    points[-1]["balance"] = {k: summary.get(k) for k in ("learner_idle_median", "actor_idle_median",
                                                         "cores_busy_median", "stale_dropped")}
    points[-1]["tokens_generated"] = summary["tokens_generated"]
    resolved = json.loads((run / "config.json").read_text())  # what "auto" chose on this run
    points[-1]["precision"] = [resolved["model"]["dtype"], resolved["learner"]["mixed_precision"]]
    return points


def trl(a, cache: Path, seed: int) -> dict:
    out = Path(a.out) / f"trl-{a.trl}-s{seed}"
    sh([a.peer_py, a.harness, "--main", REPO, "--cache", cache, "--steps", a.steps, "--generation",
        "transformers" if a.trl == "hf" else "vllm", "--seed", seed, "--out", out,
        *(["--seconds", a.trl_seconds] if a.trl_seconds else [])], Path(a.out) / f"trl-s{seed}.log")
    r = json.loads((out / "result.json").read_text())
    return {"step": r["steps"], "seconds": r["seconds"], "accuracy": r["after"]["accuracy"],
            "greedy_accuracy": r["after"]["greedy_accuracy"], "before": r["before"]}


# Our arms: the demo on its embedded defaults, with ExGRPO on, and with the precision pinned to fp32
# (actors and learner; the defaults choose bf16 where this machine computes it fast).
ARMS = {"ours": [], "exgrpo": ["exgrpo.enabled=true"], "fp32": ["model.dtype=float32", "learner.mixed_precision=none"],
        "overlap": ["learner.overlap_arrival=true"], "arrival": ["learner.wait_for_expiring=false"],
        "eta1": ["learner.max_staleness=1"], "eta2": ["learner.max_staleness=2"]}


def _cumsum(xs: list[float]) -> list[float]:
    out, t = [], 0.0
    for x in xs:
        t += x
        out.append(t)
    return out


def table(res: dict) -> str:
    med = statistics.median
    lines = ["| system | step | train s (median) | avg@8 median [min, max] | greedy median [min, max] | "
             "tokens generated (median) |", "|---|---|---|---|---|---|"]
    for name, runs in res.items():
        for i in range(len(runs[0])):
            pts = [r[i] for r in runs]
            acc, gr = [p["accuracy"] for p in pts], [p["greedy_accuracy"] for p in pts]
            tokens = [p["tokens_generated"] for p in pts if "tokens_generated" in p]
            lines.append(f"| {name} | {pts[0]['step']} | {med(p['seconds'] for p in pts):.1f} | "
                         f"{med(acc):.3f} [{min(acc):.3f}, {max(acc):.3f}] | {med(gr):.3f} [{min(gr):.3f}, {max(gr):.3f}] | "
                         f"{med(tokens) if tokens else ''} |")
    return "\n".join(lines)


def time_to(res: dict, name: str = "ours") -> dict | None:
    """Our median time (arm `name`) to TRL's median final avg@8, over TRL's median time."""
    if "trl" not in res or name not in res:
        return None
    med = statistics.median
    target, trl_s = med(r[-1]["accuracy"] for r in res["trl"]), med(r[-1]["seconds"] for r in res["trl"])
    for i in range(len(res[name][0])):
        pts = [r[i] for r in res[name]]
        if med(p["accuracy"] for p in pts) >= target:
            s = med(p["seconds"] for p in pts)
            return {"target_avg8": target, "trl_seconds": trl_s, "ours_step": pts[0]["step"], "ours_seconds": s,
                    "ratio": s / trl_s}
    return {"target_avg8": target, "trl_seconds": trl_s, "ours_step": None, "ours_seconds": None, "ratio": None}


def at_equal_steps(res: dict, name: str = "ours") -> dict | None:
    """Arm `name` against TRL at TRL's final step: our median time over TRL's (and each of our seeds'
    time over TRL's median), and both systems' avg@8 per seed with the difference of the medians. Unlike
    `time_to`, no threshold to cross: on a plateau both share, a first-crossing rule flips on a
    difference far below the seeds' spread. (Seeds are not paired: the systems share only the warm start.)"""
    if "trl" not in res or name not in res:
        return None
    med, step = statistics.median, res["trl"][0][-1]["step"]
    ours = [next((p for p in r if p["step"] == step), None) for r in res[name]]
    if any(p is None for p in ours):
        return None
    trl_s = med(r[-1]["seconds"] for r in res["trl"])
    acc_ours, acc_trl = [p["accuracy"] for p in ours], [r[-1]["accuracy"] for r in res["trl"]]
    return {"step": step, "ratio": med(p["seconds"] for p in ours) / trl_s,
            "ratio_per_seed": [p["seconds"] / trl_s for p in ours], "avg8": acc_ours, "avg8_trl": acc_trl,
            "avg8_median_diff": med(acc_ours) - med(acc_trl)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25, help="our checkpoint (and evaluation) interval, steps")
    ap.add_argument("--systems", default="ours,trl")
    ap.add_argument("--trl", choices=["hf", "vllm"], default="hf", help="TRL's generation: transformers or vLLM")
    bench.add_out(ap, "peer", help="folder for the runs and peer.json")
    ap.add_argument("--peer-py", default=str(bench.OUT / "peer-venv/bin/python"))
    ap.add_argument("--harness", default=str(REPO.parent / "shared/tools/peer/trl_toy.py"))
    ap.add_argument("--src-cache", default="~/.cache/exgrpo_async")
    ap.add_argument("--trl-seconds", type=float, default=None,
                    help="train TRL for this wall-clock budget (or --steps, whichever ends first)")
    ap.add_argument("--eval-args", default="", help="more arguments of the harness's evaluation (its --eval, "
                    "--eval-samples, --test-file: the default is avg@8 with vLLM on the toy test set)")
    ap.add_argument("--reuse", default=None, metavar="PEER_JSON",
                    help="take the systems not in --systems from an earlier peer.json (same warm start)")
    a, extra = ap.parse_known_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = freeze(Path(a.src_cache).expanduser(), out)
    seeds = [int(s) for s in a.seeds.split(",")]
    res: dict[str, list] = {}
    if a.reuse:
        earlier = json.loads(Path(a.reuse).read_text())["runs"]
        res.update({k: v for k, v in earlier.items() if k not in a.systems.split(",")})
    systems = a.systems.split(",")
    unknown = set(systems) - {*ARMS, "trl"}
    if unknown:
        raise SystemExit(f"unknown --systems {sorted(unknown)}: choose from {', '.join([*ARMS, 'trl'])}")
    for seed in seeds:  # seeds outermost: the systems share the machine's drift over the invocation
        for system in systems:
            if system == "trl":
                pts = [trl(a, cache, seed)]
            else:
                pts = ours(a, cache, seed, extra + ARMS[system], system)
            res.setdefault(system, []).append(pts)
            print(system, seed, json.dumps(pts[-1]), flush=True)
    print(table(res))
    tt = {name: time_to(res, name) for name in ARMS if name in res}
    eq = {name: at_equal_steps(res, name) for name in ARMS if name in res}
    print("time to TRL's final accuracy:", json.dumps(tt))
    print("at TRL's final step, seed by seed:", json.dumps(eq))
    bench.write_json(out / "peer.json", {"seeds": seeds, "steps": a.steps, "overrides": extra, "runs": res,
                                         "time_to_trl": tt, "at_equal_steps": eq}, indent=1)


if __name__ == "__main__":
    main()
