"""The run report: RUN_DIR/metrics.jsonl (+ summary.json, config.json) -> RUN_DIR/report/report.md with PNG plots.

Written by the learner at the end of a run and by `exgrpo-async report RUN_DIR` at any time (a run
still going or one that crashed has no summary: the report says so). A table of the held-out accuracies
(before, at each `learner.eval_every`, after). Plots (matplotlib, through exgrpo_async/report/plots.py):
reward and pass@1 (on a run of 10 steps or more, as trailing means over steps) with the held-out
accuracies, buffer composition by bucket, staleness, importance weights, throughput and step time. Unreadable metrics lines (a killed run's
last line) are skipped and counted in the report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.figure import Figure

from exgrpo_async.report.plots import Series, bar_chart, line_chart, save, stacked_area_chart


def read_metrics(path: Path) -> tuple[list[dict], list[dict], int]:
    """(step rows, eval rows, unreadable lines) of a metrics.jsonl."""
    steps, evals, bad = [], [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            bad += 1
        elif "eval" in row:
            evals.append(row)
        else:
            steps.append(row)
    return steps, evals, bad


def _col(rows: list[dict], key: str) -> list:
    return [r.get(key) for r in rows]


def _has(rows: list[dict], key: str) -> bool:
    return any(isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) for r in rows)


def _num(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def smoothing_window(n_steps: int) -> int | None:
    """Steps per point of the smoothed reward: a twentieth of the run, at least 5; None for a run shorter
    than two windows (its raw curve is short enough to read)."""
    w = max(5, n_steps // 20)
    return w if n_steps >= 2 * w else None


def trailing_mean(values: list, w: int) -> list[float | None]:
    """The mean of each value and the w-1 before it (None until w values exist; a missing value is left out)."""
    out: list[float | None] = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - w + 1):i + 1] if isinstance(v, (int, float))]
        out.append(sum(window) / len(window) if i >= w - 1 and window else None)
    return out


def reward_series(steps: list[dict], evals: list[dict], summary: dict | None) -> dict[str, Series]:
    """Reward, pass@1 and replayed reward by step (on a run long enough, each as its trailing mean over a
    window of steps: one batch's reward is noisy, about +-0.1 on the demo), held-out accuracy during
    the run and before/after it."""
    x = _col(steps, "step")
    w = smoothing_window(len(steps))
    series = {(f"{k}, mean of {w} steps" if w else k): (x, trailing_mean(_col(steps, k), w) if w else _col(steps, k))
              for k in ("reward_mean", "pass_at_1", "replay_reward_mean") if _has(steps, k)}
    if evals:
        series["eval accuracy"] = ([e["step"] for e in evals], [e["eval"].get("accuracy") for e in evals])
    for when, at in (("before", 0), ("after", steps[-1]["step"])):
        acc = ((summary or {}).get(when) or {}).get("accuracy")
        if acc is not None:
            series[f"held-out {when}"] = ([at], [acc])
    return series


def charts(steps: list[dict], evals: list[dict], summary: dict | None) -> list[tuple[str, str, Figure]]:
    """(file name, title, figure) of every plot the rows support, in report order."""
    x = _col(steps, "step")
    out: list[tuple[str, str, Figure]] = []

    def lines(name: str, title: str, keys: list[str], ylabel: str = "") -> None:
        series = {k: (x, _col(steps, k)) for k in keys if _has(steps, k)}
        if series:
            out.append((name, title, line_chart(title, series, ylabel=ylabel)))

    title = "Reward and pass@1"
    out.append(("reward.png", title, line_chart(title, reward_series(steps, evals, summary), ylabel="share (0..1)")))

    # buffer composition by bucket k (ExGRPO)
    if any(r.get("buckets") for r in steps):
        ks = sorted({k for r in steps for k in (r.get("buckets") or {})}, key=int)
        layers = {f"k={k}": [(r.get("buckets") or {}).get(k, 0) for r in steps] for k in ks}
        title = "Buffer: questions per bucket k"
        out.append(("buffer.png", title, stacked_area_chart(title, x, layers, ylabel="questions")))
        lines("buffer_size.png", "Buffer size and retired questions",
              ["buffer_questions", "retired_total", "experience_questions"], "questions")

    # staleness over steps and its distribution
    lines("staleness.png", "Staleness (policy versions)", ["staleness_mean", "staleness_max"], "versions")
    hist: dict[int, int] = {}
    for r in steps:
        for lag, n in (r.get("staleness_hist") or {}).items():
            hist[int(lag)] = hist.get(int(lag), 0) + int(n)
    if hist:
        lags = list(range(0, max(hist) + 1))
        title = "Groups trained, by staleness"
        bars = bar_chart(title, [str(g) for g in lags], [hist.get(g, 0) for g in lags], xlabel="versions behind",
                         ylabel="groups")
        out.append(("staleness_hist.png", title, bars))

    # importance weights and ratios
    lines("weights.png", "Importance weights and PPO ratio",
          ["is_weight_mean", "is_weight_max", "ratio_max", "replay_w_mean", "replay_w_max"])
    lines("truncation.png", "Truncated and clipped shares", ["is_truncated_frac", "clip_frac", "truncated_frac"],
          "share (0..1)")

    # throughput and where the step time goes
    lines("rollouts_per_s.png", "Throughput: rollouts/s", ["rollouts_per_s"], "1/s")
    lines("tokens_per_s.png", "Throughput: tokens/s", ["tokens_per_s"], "1/s")
    lines("step_time.png", "Step time", ["step_seconds", "train_seconds", "wait_seconds"], "seconds")
    return out


def held_out_curve(evals: list[dict], summary: dict | None, last_step: int) -> list[dict]:
    """The run's held-out accuracies: before training (step 0), each evaluation during it (the eval
    rows of metrics.jsonl, resumed parts included) and after it; [] without any."""
    points = [(0, (summary or {}).get("before")), *((e["step"], e["eval"]) for e in evals),
              (last_step, (summary or {}).get("after"))]
    return [{"step": step, "accuracy": ev.get("accuracy"), "greedy_accuracy": ev.get("greedy_accuracy")}
            for step, ev in points if ev]


def held_out_table(evals: list[dict], summary: dict | None, last_step: int) -> list[str]:
    """report.md's table of the held-out accuracies during the run: before, each evaluation, after."""
    curve = held_out_curve(evals, summary, last_step)
    if not curve:
        return []
    rows = [f"| {p['step']} | {_num(p['accuracy'])} | {_num(p['greedy_accuracy'])} |" for p in curve]
    return ["", "## Held-out accuracy during the run", "", "| step | sampled (avg@n) | greedy |", "|---|---|---|", *rows]


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write report.md and its PNGs to out_dir (default RUN_DIR/report); returns the report's path."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run folder, or the run has not trained a step)")
    steps, evals, bad = read_metrics(metrics)
    if not steps:
        raise ValueError(f"{metrics}: no learner step recorded yet ({bad} unreadable lines)")
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    figures: list[tuple[str, str]] = []  # (title, file name)
    for name, title, fig in charts(steps, evals, summary):
        save(fig, out / name)
        figures.append((title, name))
    notes = [] if any(r.get("buckets") for r in steps) else [
        "No buffer plots: the run had no ExGRPO experience buffer (exgrpo.enabled=false)."]

    last = steps[-1]
    lines = [f"# Run report: {run_dir.name}", "",
             f"{len(steps)} learner steps (step {steps[0]['step']} to {last['step']}), model "
             f"`{(config.get('model') or {}).get('path', '?')}`, ExGRPO "
             f"{'on' if (config.get('exgrpo') or {}).get('enabled') else 'off'}."]
    if bad:
        lines.append(f"{bad} unreadable line(s) of metrics.jsonl were skipped.")
    if summary is None:
        lines.append("No summary.json: the run is still going, or it ended before its final evaluation.")
    else:
        before, after = summary.get("before") or {}, summary.get("after") or {}
        lines += ["", "| summary | value |", "|---|---|",
                  f"| held-out accuracy before -> after | {_num(before.get('accuracy'))} -> {_num(after.get('accuracy'))} |",
                  f"| greedy accuracy before -> after | {_num(before.get('greedy_accuracy'))} -> "
                  f"{_num(after.get('greedy_accuracy'))} |",
                  f"| held-out standard error (sampled), before -> after | {_num(before.get('accuracy_se'))} -> "
                  f"{_num(after.get('accuracy_se'))} |"]
        gain = summary.get("gain")
        if gain:  # the same questions scored twice: the paired difference's error (learner/inbox.py paired_gain)
            lines += [f"| held-out gain ({name}) ± paired standard error | {gain[name]:+.3f} ± {gain[name + '_se']:.3f} "
                      f"over {gain[name + '_questions']} questions |" for name in ("sampled", "greedy")]
        for key in ("rl_seconds", "rollouts_per_s", "tokens_per_s", "sync_seconds_mean", "skipped_steps",
                    "stale_dropped", "actors_joined", "actors_lost", "questions_unaccounted"):
            if key in summary:
                lines.append(f"| {key} | {_num(summary[key])} |")
    lines += held_out_table(evals, summary, last["step"])
    lines += ["", f"## Last step ({last['step']})", "", "| metric | value |", "|---|---|"]
    for key in ("reward_mean", "pass_at_1", "staleness_mean", "staleness_max", "is_weight_max", "clip_frac",
                "mismatch_kl", "rollouts_per_s", "tokens_per_s", "step_seconds", "actors", "buffer_trajectories",
                "skipped_steps_total", "stale_dropped_total"):
        if key in last:
            lines.append(f"| {key} | {_num(last[key], 4)} |")
    lines += ["", "## Plots", ""] + [n for n in notes] + [""]
    for title, name in figures:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
