"""Learning: named arms (plain GRPO, ExGRPO, its ablations) over seeds, each to the same budget of
generated tokens, held-out accuracy against generated tokens.

Each arm-seed is a real `exgrpo-async train` on the cached toy policy (2 vLLM actors, seeded sampling,
learner seed and data order = the seed: the arms of one seed see the same question order, the seeds
different ones; before issue 35 every seed drew the same order) that stops once `--tokens` fresh completion tokens have been generated
(`learner.max_generated_tokens`; replayed trajectories are not generated work) and evaluates the
held-out set (avg@8 sampled, greedy) at start, every `--eval-every` tokens and at the end. Curves are
interpolated onto the grid 0, E, 2E, ..., tokens, so arms compare at equal generated tokens.

Scenarios (`--scenario`): the demo's settings; a high learning rate; a weaker warm start; and "regime",
issue 35's regime-matched one: a finite pool of tokens / (2 x 286) toy questions, so that on-policy GRPO
goes through it about twice within the budget, as the paper's runs go through theirs (retirement then
prunes the later epochs). The arm "no_replay" (ExGRPO at rho 0: its retirement, nothing replayed) beside
"grpo" and "exgrpo" shows the replay's own share of a difference.

The held-out set is the toy test set (1,000 questions; 200 before 2026-11-28) unless `--heldout-per-kind N` asks for N questions of
each kind drawn apart from the training pool and the test set (the same questions for every arm and seed).
Each evaluation records two standard errors (learner/inbox.py): over questions (the population's
accuracy) and from the samples alone (questions fixed: the noise between two arms scored on the same set).

Per arm: final accuracy and area under the curve (mean accuracy over the grid), mean and spread (std,
min..max) over seeds; per arm but the first, its difference to the first (paired by seed); the
learner's compute per step (update + ExGRPO's selection pass, median over steps) and its ratio to the
first arm's. Writes
`--out/learning-<scenario>.json` and a plot `.png` (mean line and min..max band per arm).

    .venv/bin/python ops/bench/learning/learning.py --scenario demo --arms grpo,exgrpo --seeds 0,1,2 \
        [--tokens 600000] [--eval-every 150000] [--heldout-per-kind 0] [--out bench_out] [extra dotted overrides...]
    .venv/bin/python ops/bench/learning/learning.py --report bench_out/learning-demo.json [more.json ...]
        # table and plot again; several files (same --tokens and --eval-every) are merged, the first
        # file's first arm the baseline
    .venv/bin/python ops/bench/learning/learning.py --report A.json B.json --by-seed --arms grpo,...
        # one row per seed over those arms' runs: start, final and gain (the question order's share)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from matplotlib.ticker import FuncFormatter

from exgrpo_async.report import plots

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402

# every arm shares the loss terms and schedule of the demo; only what the arm names differs
ARMS: dict[str, list[str]] = {
    "grpo": ["exgrpo.enabled=false"],
    "exgrpo": ["exgrpo.enabled=true"],
    "exgrpo_nodelay": ["exgrpo.enabled=true", "exgrpo.delayed_start=false"],
    "exgrpo_nodelay_no_shaping": ["exgrpo.enabled=true", "exgrpo.delayed_start=false", "exgrpo.shaping_beta=none"],
    "exgrpo_per_question": ["exgrpo.enabled=true", "exgrpo.question_weighting=gaussian_per_question"],
    "no_question_selection": ["exgrpo.enabled=true", "exgrpo.question_weighting=uniform"],
    "no_trajectory_selection": ["exgrpo.enabled=true", "exgrpo.selection=random"],
    "highest_entropy": ["exgrpo.enabled=true", "exgrpo.selection=highest_entropy"],
    "no_shaping": ["exgrpo.enabled=true", "exgrpo.shaping_beta=none"],
    "no_is_correction": ["exgrpo.enabled=true", "exgrpo.importance_correction=false"],
    "rho_0.25": ["exgrpo.enabled=true", "exgrpo.rho=0.25"],
    "rho_0.75": ["exgrpo.enabled=true", "exgrpo.rho=0.75"],
    "reinject": ["exgrpo.enabled=true", "exgrpo.reinject_every=25"],
    # ExGRPO with nothing replayed (rho 0): on-policy batches with its retirement of solved questions (and
    # its clip schedule); against "exgrpo" it shows the replay's own share of a gain
    "no_replay": ["exgrpo.enabled=true", "exgrpo.rho=0"],
    # the learning rate (the demo's is 5e-5): how fast the 200-step demo can move the held-out accuracy
    "grpo_lr_1e-4": ["exgrpo.enabled=false", "learner.lr=1e-4"],
    "exgrpo_lr_1e-4": ["exgrpo.enabled=true", "learner.lr=1e-4"],
    "grpo_lr_3e-5": ["exgrpo.enabled=false", "learner.lr=3e-5"],
    "grpo_lr_2e-5": ["exgrpo.enabled=false", "learner.lr=2e-5"],
    # twice the samples per question on half the questions (the same generated tokens per step): a question
    # the policy solves once in 16 gives a group with signal, where 8 samples mostly come back all wrong
    "grpo_k16": ["exgrpo.enabled=false", "rollout.samples_per_question=16", "learner.questions_per_step=16"],
    # the paper's sampler ablation (sigma 0.5 and 1.5 around its 1.0): a wider Gaussian spreads the draws over
    # more buckets, a narrower one concentrates them on k = K/2
    "sigma_1.5": ["exgrpo.enabled=true", "exgrpo.sigma=1.5"],
    "sigma_0.5": ["exgrpo.enabled=true", "exgrpo.sigma=0.5"],
    # the paper's "hard-biased" sampler, mu 0.25 of K in accuracy units: bucket 2 of 8 in the count units
    # the sampler works in
    "mu_0.25": ["exgrpo.enabled=true", "exgrpo.mu=2.0"],
    # both selections off together (Table 6): questions uniformly from the buffer, a random stored trajectory
    "no_selection": ["exgrpo.enabled=true", "exgrpo.question_weighting=uniform", "exgrpo.selection=random"],
}
SCENARIOS: dict[str, list[str]] = {
    "demo": [],  # the demo's warm start and learning rate: partly solved questions, pass rates over 0..1
    "weak": ["learner.lr=3e-4"],  # where on-policy GRPO collapses (the paper's Llama case, in spirit)
    # a weaker warm start (450 SFT steps: held-out greedy 0.235, sampled 0.13): few correct answers, the
    # regime where replaying rare successes should help (the paper's Llama case: no delayed start there)
    "short_warmstart": ["toy.sft_steps=450"],
    # the paper's regime (issue 35), fixed before its first run: a finite pool that on-policy GRPO goes
    # through about twice in the budget (the paper: 46k questions, B = 128, 700 steps, 1.95 epochs), so
    # retirement prunes the later epochs; `regime_pool` writes it (the demo's warm start otherwise)
    "regime": [],
}
REGIME_EPOCHS = 2
# GRPO's fresh completion tokens per question on the toy task (8 samples of about 36 tokens): issue 35's
# trial put 1,400 questions at about 2 epochs in 800k tokens
REGIME_TOKENS_PER_QUESTION = 286
# the larger held-out set's questions (--heldout-per-kind): one draw, the same for every arm and seed
HELDOUT_SEED = 35


def regime_pool(tokens: int, out: Path, extra: list[str]) -> Path:
    """The regime scenario's training pool: the first tokens / (2 x 286) questions of the toy pool
    (random kinds; disjoint from the held-out set as the whole pool is), as JSONL in `out`."""
    from exgrpo_async.config_io import load_config
    from exgrpo_async.runs import resolve_toy

    n = round(tokens / (REGIME_EPOCHS * REGIME_TOKENS_PER_QUESTION))
    (full,) = resolve_toy(load_config(None, extra)).data.train_files
    rows = Path(full).read_text().splitlines(keepends=True)
    if n > len(rows):
        raise ValueError(f"--tokens {tokens} wants a {n}-question pool; the toy pool has {len(rows)}")
    pool = out / f"regime-pool-{n}.jsonl"
    pool.write_text("".join(rows[:n]))
    return pool


def draw_heldout(per_kind: int, exclude: set[str]) -> list[dict]:
    """`per_kind` distinct toy questions of each test kind, none in `exclude`, drawn from HELDOUT_SEED
    (the same draw every time). Raises if a kind has too few left: mul21 has 720 questions in all, and
    the default pool covers nearly all of them, a regime pool about a third."""
    from exgrpo_async.toy.task import TEST_KINDS, make_question

    rng, rows, seen = random.Random(HELDOUT_SEED), [], set(exclude)
    for kind in TEST_KINDS:
        n = 0
        for _ in range(200 * per_kind):
            q, _, ans = make_question(kind, rng)
            if q not in seen:
                seen.add(q)
                rows.append({"problem": q, "answer": str(ans), "kind": kind})
                n += 1
                if n == per_kind:
                    break
        if n < per_kind:
            raise ValueError(f"--heldout-per-kind {per_kind}: only {n} {kind} questions are outside the training "
                             f"pool and the toy test set")
    return rows


def heldout_file(per_kind: int, extra: list[str], out: Path) -> Path:
    """The held-out set of `draw_heldout`, apart from the training pool the runs use (`extra`'s
    data.train_files, or the toy pool) and the toy test set, as JSONL in `out`: one set for every arm
    and seed."""
    from exgrpo_async.config_io import load_config
    from exgrpo_async.runs import resolve_toy

    cfg = resolve_toy(load_config(None, extra))
    exclude = {json.loads(x)["problem"] for f in [*cfg.data.train_files, cfg.data.eval_file]
               for x in Path(f).read_text().splitlines() if x.strip()}
    rows = draw_heldout(per_kind, exclude)
    path = out / f"heldout-{per_kind}x{len(rows) // per_kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_arm(arm: str, seed: int, scenario: str, tokens: int, every: int, extra: list[str], out: Path) -> dict:
    run_root = out / f"{scenario}-{arm}-s{seed}"
    args = [sys.executable, "-m", "exgrpo_async.launcher.cli", "train", *SCENARIOS[scenario], *ARMS[arm],
            f"learner.seed={seed}", f"data.shuffle_seed={seed}", "rollout.seeded=true",
            "rollout.eval_samples=8",  # avg@8, as every figure of this bench was measured (the demo's default is 2)
            f"learner.max_generated_tokens={tokens}",
            f"learner.eval_every_tokens={every}", "learner.max_steps=100000", "learner.checkpoint_every=0",
            "metrics.port=none", "metrics.actor_port=none", f"output_dir={run_root}", *extra]
    t0 = time.time()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed:\n{proc.stderr[-3000:]}")
    run_dir = max(run_root.iterdir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r for r in rows if "eval" not in r]
    points = [(0, summary["before"]["accuracy"], summary["before"]["greedy_accuracy"])]
    points += [(r["tokens_generated_total"], r["eval"]["accuracy"], r["eval"]["greedy_accuracy"]) for r in rows if "eval" in r]
    points.append((summary["tokens_generated"], summary["after"]["accuracy"], summary["after"]["greedy_accuracy"]))
    tail = steps[-10:]
    return {"arm": arm, "seed": seed, "run_dir": str(run_dir), "wall_s": time.time() - t0, "steps": len(steps),
            "points": points, "step_seconds_median": statistics.median(r["train_seconds"] + (r.get("selection_seconds") or 0.0)
                                                 for r in steps),
            "reward_last10": statistics.mean(r["reward_mean"] for r in tail),
            "eval_se_final": summary["after"].get("accuracy_se"),
            "eval_sampling_se_final": summary["after"].get("accuracy_sampling_se"),
            "experience_questions_total": sum(r.get("experience_questions", 0) for r in steps),
            "mixed_from_step": next((r["step"] for r in steps if r.get("exgrpo_mixed")), None),
            "retired_total": steps[-1].get("retired_total"), "replay_top10_share": steps[-1].get("replay_top10_share")}


def replay_health(run_dir: str, after_step: int = 20) -> dict | None:
    """From an ExGRPO run's metrics: the share of experience draws from the medium buckets (k = 3..5 of 8)
    after `after_step`, the questions those buckets offered the sampler, and the replay concentration
    at the end (None for a run without replay)."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "eval" not in r and r.get("experience_by_bucket") is not None]
    late = [r for r in rows if r["step"] > after_step]
    drawn = sum(sum(r["experience_by_bucket"].values()) for r in late)
    if not drawn:
        return None
    medium = ("3", "4", "5")
    pools = [sum(r["sampler_pools"].get(k, 0) for k in medium) for r in late if r.get("sampler_pools")]
    last = rows[-1]
    return {"medium_draw_share": sum(r["experience_by_bucket"].get(k, 0) for r in late for k in medium) / drawn,
            "medium_pool_mean": statistics.mean(pools) if pools else None,
            "buffer_questions_end": last["buffer_questions"], "buckets_end": last["buckets"],
            "replays_total": last["replays_total"], "replayed_questions_total": last["replayed_questions_total"],
            "replay_count_max": last["replay_count_max"], "replay_top10_share": last["replay_top10_share"],
            "replay_age_mean_late": statistics.mean(r["replay_age_mean"] for r in late if r.get("replay_age_mean") is not None)}


def on_grid(points: list, grid: list[int], col: int) -> list[float]:
    """Linear interpolation of (tokens, sampled, greedy) points onto `grid` (held flat past the ends)."""
    xs, ys = [p[0] for p in points], [p[col] for p in points]
    out = []
    for g in grid:
        if g <= xs[0]:
            out.append(ys[0])
        elif g >= xs[-1]:
            out.append(ys[-1])
        else:
            j = next(i for i in range(1, len(xs)) if xs[i] >= g)
            t = (g - xs[j - 1]) / max(1, xs[j] - xs[j - 1])
            out.append(ys[j - 1] + t * (ys[j] - ys[j - 1]))
    return out


def spread(v: list[float]) -> dict:
    return {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "min": min(v), "max": max(v),
            "n": len(v)}


def analyse(runs: list[dict], tokens: int, every: int) -> dict:
    grid = list(range(0, tokens + 1, every))
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    out: dict = {"grid": grid, "arms": {}}
    for arm in arms:
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        curves = {col: [on_grid(r["points"], grid, i) for r in mine] for i, col in ((1, "sampled"), (2, "greedy"))}
        out["arms"][arm] = {
            "seeds": [r["seed"] for r in mine], "curves": curves,
            **{f"{m}_{col}": spread([c[-1] if m == "final" else statistics.mean(c) for c in curves[col]])
               for m in ("final", "auc") for col in ("sampled", "greedy")},
            "start_sampled": spread([c[0] for c in curves["sampled"]]),
            "step_seconds_median": statistics.median(r["step_seconds_median"] for r in mine),
            "steps": spread([r["steps"] for r in mine]),
            "wall_s": spread([r["wall_s"] for r in mine]),
            **{k: spread(v) if (v := [r[k] for r in mine if r.get(k) is not None]) else None
               for k in ("eval_se_final", "eval_sampling_se_final")},
            "experience_questions_total": spread([r["experience_questions_total"] for r in mine]),
            "replay_health": [h for r in mine if (h := replay_health(r["run_dir"])) is not None],
        }
    base = arms[0]
    for arm in arms[1:]:
        a, b = out["arms"][arm], out["arms"][base]
        seeds = sorted(set(a["seeds"]) & set(b["seeds"]))
        for m in ("final", "auc"):
            for col in ("sampled", "greedy"):
                pick = lambda x: [x["curves"][col][x["seeds"].index(s)] for s in seeds]  # noqa: E731
                diffs = [(c[-1] if m == "final" else statistics.mean(c)) - (d[-1] if m == "final" else statistics.mean(d))
                         for c, d in zip(pick(a), pick(b))]
                a[f"minus_{base}_{m}_{col}"] = spread(diffs) if diffs else None
        a["step_time_ratio"] = a["step_seconds_median"] / b["step_seconds_median"]
    return out


def seed_table(runs: list[dict], tokens: int, every: int) -> str:
    """Per seed, over every run given (of any arm): held-out sampled at the start and at `tokens`, and
    the gain from each run's own start (mean ± std, points). Shows how much of a spread is the question
    order and the starting evaluation's draw (both the seed's), not the arm."""
    grid = list(range(0, tokens + 1, every))
    lines = ["| seed | runs | start sampled | final sampled | gain (points) |", "|" + "---|" * 5]
    for seed in sorted({r["seed"] for r in runs}):
        curves = [on_grid(r["points"], grid, 1) for r in runs if r["seed"] == seed]
        start, final = spread([c[0] for c in curves]), spread([c[-1] for c in curves])
        gain = spread([100 * (c[-1] - c[0]) for c in curves])
        lines.append(f"| {seed} | {len(curves)} | {start['mean']:.3f} | {final['mean']:.3f} ± {final['std']:.3f} | "
                     f"{gain['mean']:+.1f} ± {gain['std']:.1f} |")
    return "\n".join(lines)


def health_table(res: dict) -> str:
    lines = ["| arm | draws from k=3..5 (after step 20) | k=3..5 questions offered | buffer questions (end) | "
             "replays per replayed question (mean / max) | top-10 share | replay age (versions) |", "|" + "---|" * 7]
    for arm, a in res["arms"].items():
        hs = a["replay_health"]
        if not hs:
            continue
        m = lambda key: statistics.mean(h[key] for h in hs)  # noqa: E731
        lines.append(f"| {arm} | {m('medium_draw_share'):.0%} | {m('medium_pool_mean'):.1f} | "
                     f"{m('buffer_questions_end'):.0f} | {m('replays_total') / m('replayed_questions_total'):.1f} / "
                     f"{m('replay_count_max'):.0f} | {m('replay_top10_share'):.0%} | {m('replay_age_mean_late'):.1f} |")
    return "\n".join(lines)


def table(res: dict) -> str:
    f = lambda s: f"{s['mean']:.3f} ± {s['std']:.3f}" if s else "-"  # noqa: E731
    arms = list(res["arms"])
    lines = ["| arm | seeds | final sampled | final greedy | AUC sampled | " + f"minus {arms[0]}: final sampled | "
             f"minus {arms[0]}: AUC sampled | learner s/step (ratio) | steps | wall s | one eval's SE: over questions / sampling |", "|" + "---|" * 11]
    for arm, a in res["arms"].items():
        se = " / ".join(f"{a[k]['mean']:.3f}" if a.get(k) else "-"  # older JSONs lack them
                        for k in ("eval_se_final", "eval_sampling_se_final"))
        wall = f"{a['wall_s']['mean']:.0f}" if a.get("wall_s") else "-"
        lines.append(f"| {arm} | {len(a['seeds'])} | {f(a['final_sampled'])} | {f(a['final_greedy'])} | "
                     f"{f(a['auc_sampled'])} | {f(a.get(f'minus_{arms[0]}_final_sampled'))} | "
                     f"{f(a.get(f'minus_{arms[0]}_auc_sampled'))} | {a['step_seconds_median']:.2f} "
                     f"({a.get('step_time_ratio', 1.0):.2f}x) | {a['steps']['mean']:.0f} | {wall} | {se} |")
    return "\n".join(lines)


def plot(res: dict, path: Path, title: str) -> None:
    """Held-out accuracy (sampled, greedy) against generated tokens: per arm the mean over seeds as a line
    and min..max as a band (exgrpo_async/report/plots.py, as the run report)."""
    fig, axes = plots.figure(ncols=2, size=(11.0, 4.0))
    for ax, col in zip(axes, ("sampled", "greedy")):
        plots.draw_bands(ax, res["grid"], {f"{arm} (n={len(a['curves'][col])})": a["curves"][col]
                                           for arm, a in res["arms"].items()})
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:.0f}k"))
        ax.set_ylabel(f"held-out accuracy ({'avg@8' if col == 'sampled' else 'greedy'})")
    plots.finish(fig, title + " (line: mean over seeds; band: min..max)", xlabel="fresh completion tokens generated")
    plots.save(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="demo")
    ap.add_argument("--arms", default="grpo,exgrpo", help=f"comma list of {', '.join(ARMS)}; the first is the baseline")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tokens", type=int, default=600_000)
    ap.add_argument("--eval-every", type=int, default=150_000)
    bench.add_out(ap, "", help="folder for the runs, the JSON and the plot")
    ap.add_argument("--heldout-per-kind", type=int, default=0,
                    help="score a held-out set of this many questions per kind, disjoint from the training pool "
                         "(default 0: the toy test set, 40 per kind)")
    ap.add_argument("--name", help="output file stem (default learning-<scenario>)")
    ap.add_argument("--report", nargs="+", help="re-print the table and plot of finished JSONs (merged)")
    ap.add_argument("--by-seed", action="store_true",
                    help="with --report: one row per seed over the runs of --arms in the files, at the smallest "
                         "--tokens among them (the files must share --scenario and --eval-every)")
    args, extra = ap.parse_known_args()
    if args.report and args.by_seed:
        docs = [json.loads(Path(p).read_text()) for p in args.report]
        if len({(d["eval_every"], d["scenario"]) for d in docs}) != 1:
            ap.error("--report --by-seed files must share --scenario and --eval-every")
        runs = [r for d in docs for r in d["runs"] if r["arm"] in args.arms.split(",")]
        print(seed_table(runs, min(d["tokens"] for d in docs), docs[0]["eval_every"]))
        return 0
    if args.report:
        docs = [json.loads(Path(p).read_text()) for p in args.report]
        if len({(d["tokens"], d["eval_every"], d["scenario"]) for d in docs}) != 1:
            ap.error("--report files must share --scenario, --tokens and --eval-every")
        res = analyse([r for d in docs for r in d["runs"]], docs[0]["tokens"], docs[0]["eval_every"])
        print(table(res))
        print(health_table(res))
        png = Path(args.report[0]).with_suffix(".png") if len(docs) == 1 else Path(args.out) / f"{args.name or 'merged'}.png"
        plot(res, png, f"scenario {docs[0]['scenario']}")
        print(f"wrote {png}")
        return 0
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        ap.error(f"unknown arms {unknown}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name or 'learning-' + args.scenario}.json"
    if args.scenario == "regime":  # its pool, written once for every arm and seed (and recorded in the JSON)
        extra = [f"data.train_files=[\"{regime_pool(args.tokens, out, extra)}\"]", *extra]
    if args.heldout_per_kind:  # apart from that pool (or the toy pool)
        extra = [f"data.eval_file={heldout_file(args.heldout_per_kind, extra, out)}", *extra]
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:  # seed-major: a partial result is paired
        for arm in arms:
            r = run_arm(arm, seed, args.scenario, args.tokens, args.eval_every, extra, out)
            runs.append(r)
            print(f"{arm} seed {seed}: {r['steps']} steps, {r['wall_s']:.0f}s, sampled "
                  f"{r['points'][0][1]:.3f} -> {r['points'][-1][1]:.3f}, greedy {r['points'][0][2]:.3f} -> "
                  f"{r['points'][-1][2]:.3f}", flush=True)
            doc = {"scenario": args.scenario, "overrides": SCENARIOS[args.scenario] + extra, "tokens": args.tokens,
                   "eval_every": args.eval_every, "arms": {a: ARMS[a] for a in arms}, "runs": runs}
            bench.write_json(path, doc, indent=1, say=False)  # after each run: a stopped bench keeps what it ran
    res = analyse(runs, args.tokens, args.eval_every)
    doc["result"] = {k: v for k, v in res.items()}
    bench.write_json(path, doc, indent=1, say=False)
    print(table(res))
    print(health_table(res))
    plot(res, path.with_suffix(".png"), f"scenario {args.scenario}")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
