"""The run report, drawn with matplotlib (exgrpo_async/report/plots.py): from a recorded metrics.jsonl every plot
is a readable 800x400 PNG, series that coincide (reward_mean and pass_at_1 on a toy run) are drawn
distinguishably, gaps stay gaps, and report.md references every plot, counts unreadable metrics lines and
says what it could not plot."""

import json
import re

import numpy as np
import pytest
from matplotlib.image import imread

from exgrpo_async.report.plots import bar_chart, draw_bands, figure, line_chart, stacked_area_chart
from exgrpo_async.report.write import charts, held_out_table, read_metrics, write_report

PLOTS = {"reward.png", "buffer.png", "buffer_size.png", "staleness.png", "staleness_hist.png", "weights.png",
         "rollouts_per_s.png", "tokens_per_s.png", "step_time.png"}


def _run(tmp_path, exgrpo: bool) -> object:
    run = tmp_path / ("ex" if exgrpo else "plain")
    run.mkdir()
    rows = []
    for step in range(1, 6):
        row = {"step": step, "policy_version": step, "reward_mean": 0.1 * step, "pass_at_1": 0.1 * step,
               "staleness_mean": 0.5, "staleness_max": 1, "staleness_hist": {"0": 2, "1": 2},
               "is_weight_mean": 1.0, "is_weight_max": 1.5, "rollouts_per_s": 100.0, "tokens_per_s": 3000.0,
               "step_seconds": 1.0, "train_seconds": 0.8, "wait_seconds": 0.2}
        if exgrpo:
            row.update(buckets={"1": step, "2": 2 * step, "3": 1}, buffer_questions=3 * step, retired_total=step)
        rows.append(json.dumps(row))
    rows.insert(3, json.dumps({"step": 3, "policy_version": 3, "eval": {"accuracy": 0.4}}))
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 6, "policy_ver')  # killed mid-line
    (run / "config.json").write_text(json.dumps({"model": {"path": "toy"}, "exgrpo": {"enabled": exgrpo}}))
    return run


def _style(line) -> tuple:
    return line.get_color(), line.get_linestyle(), line.get_marker(), line.get_markerfacecolor()


def test_report_of_an_exgrpo_run_has_every_plot(tmp_path):
    path = write_report(_run(tmp_path, exgrpo=True))
    text = path.read_text()
    assert path == tmp_path / "ex" / "report" / "report.md"
    pngs = re.findall(r"^!\[[^\]]*\]\(([^)]+)\)$", text, re.M)
    assert PLOTS <= set(pngs)
    for name in pngs:
        img = imread(path.parent / name)
        assert img.shape == (400, 800, 4), name
        assert img[..., :3].std() > 0.05, f"{name} is blank"
    assert "1 unreadable line(s)" in text and "5 learner steps" in text and "No summary.json" in text


def test_the_reward_chart_shows_reward_and_pass_at_1_apart_when_they_coincide(tmp_path):
    steps, evals, bad = read_metrics(_run(tmp_path, exgrpo=True) / "metrics.jsonl")
    assert (len(steps), len(evals), bad) == (5, 1, 1)
    drawn = {name: fig for name, _, fig in charts(steps, evals, {"before": {"accuracy": 0.2}})}
    assert PLOTS <= set(drawn)
    ax = drawn["reward.png"].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"reward_mean", "pass_at_1", "eval accuracy", "held-out before"}
    reward, passed = lines["reward_mean"], lines["pass_at_1"]
    assert list(reward.get_ydata()) == list(passed.get_ydata())  # the same values ...
    assert _style(reward) != _style(passed) and reward.get_linestyle() != passed.get_linestyle()  # ... told apart
    assert reward.get_linewidth() > passed.get_linewidth() and reward.get_zorder() < passed.get_zorder()
    held = lines["held-out before"]
    assert held.get_linestyle() == "None" and held.get_marker() not in (None, "None", "")  # one point: a marker
    assert ax.get_ylabel() and ax.get_xlabel() == "step"
    legend = drawn["reward.png"].legends[0]
    assert [t.get_text() for t in legend.get_texts()] == list(lines)


def test_labels_and_legend_fit_inside_the_figure(tmp_path):
    fig = line_chart("t", {"a_long_metric_name": ([1, 2, 3], [0.1, 0.2, 0.3]), "b": ([1, 2, 3], [3e4, 2e4, 1e4])},
                     ylabel="a y label that is long")
    fig.savefig(tmp_path / "x.png")  # constrained layout runs at draw time
    box = fig.bbox
    for artist in (fig.axes[0].yaxis.label, fig.axes[0].xaxis.label, fig.legends[0]):
        extent = artist.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, artist
    assert fig.legends[0].get_window_extent().x0 >= fig.axes[0].get_window_extent().x1  # hides no data


def test_a_one_step_run_draws_points_that_both_show():
    fig = line_chart("one step", {"reward_mean": ([4], [0.5]), "pass_at_1": ([4], [0.5])})
    ax = fig.axes[0]
    first, second = ax.get_lines()
    assert first.get_linestyle() == second.get_linestyle() == "None"
    assert first.get_marker() != second.get_marker() and second.get_markerfacecolor() == "none"  # hollow on top
    assert all(float(t).is_integer() for t in ax.get_xticks()) and ax.get_xlim()[0] < 4 < ax.get_xlim()[1]


def test_none_and_nan_are_gaps_and_a_point_between_gaps_is_a_marker():
    fig = line_chart("gaps", {"a": ([1, 2, 3, 4, 5], [0.1, None, 0.3, float("nan"), 0.5])})
    (line,) = fig.axes[0].get_lines()
    y = line.get_ydata()
    assert np.isnan(y[1]) and np.isnan(y[3]) and line.get_marker() not in (None, "None", "")
    many = [float(i) for i in range(100)]
    many[50:53] = [None, 7.0, None]  # dense: no markers but on the lone point
    (line,) = line_chart("dense", {"a": (list(range(100)), many)}).axes[0].get_lines()
    assert list(np.nonzero(line.get_markevery())[0]) == [51]


def test_stacked_area_bars_and_bands(tmp_path):
    fig = stacked_area_chart("stack", [1, 2, 3], {"k=1": [1, 2, 3], "k=2": [None, 1, 1]})
    assert len(fig.axes[0].collections) == 2 and fig.axes[0].get_ylim()[1] >= 4
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["k=2", "k=1"]  # top layer first
    one = stacked_area_chart("one step", [7], {"k=1": [1], "k=2": [2]})
    assert [p.get_height() for p in one.axes[0].patches] == [1, 2] and one.axes[0].get_xlim()[0] < 7
    bars = bar_chart("bars", ["0", "1", "2"], [10, 0, 4])
    assert [p.get_height() for p in bars.axes[0].patches] == [10, 0, 4]
    assert [t.get_text() for t in bars.axes[0].get_xticklabels()] == ["0", "1", "2"]
    fig, (ax,) = figure()
    draw_bands(ax, [0, 1, 2], {"a": [[0.1, 0.2, 0.3], [0.3, 0.4, 0.5]]})
    (line,) = ax.get_lines()
    assert np.allclose(line.get_ydata(), [0.2, 0.3, 0.4]) and len(ax.collections) == 1


def test_report_without_exgrpo_says_why_the_buffer_is_missing(tmp_path):
    path = write_report(_run(tmp_path, exgrpo=False))
    assert "exgrpo.enabled=false" in path.read_text() and not (path.parent / "buffer.png").exists()


def test_report_of_a_run_without_steps_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="no learner step recorded yet \\(1 unreadable"):
        write_report(tmp_path)


def _long_run(tmp_path, n: int = 40):
    """n steps of a noisy reward, evaluations at steps 10 and 20, a summary with before and after."""
    rng = np.random.default_rng(0)
    rewards = [float(v) for v in rng.random(n)]
    rows = [{"step": s, "policy_version": s, "reward_mean": r, "pass_at_1": r} for s, r in zip(range(1, n + 1), rewards)]
    rows.insert(10, {"step": 10, "policy_version": 10, "eval": {"accuracy": 0.3, "greedy_accuracy": 0.35}})
    rows.insert(21, {"step": 20, "policy_version": 20, "eval": {"accuracy": 0.4, "greedy_accuracy": 0.45}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"before": {"accuracy": 0.2, "greedy_accuracy": 0.25}, "after": {"accuracy": 0.5, "greedy_accuracy": 0.55},
               "best": None}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return rewards, summary


def test_a_long_runs_reward_is_drawn_smoothed_and_its_held_out_evaluations_tabled(tmp_path):
    rewards, summary = _long_run(tmp_path)
    steps, evals, _ = read_metrics(tmp_path / "metrics.jsonl")
    drawn = {name: fig for name, _, fig in charts(steps, evals, summary)}
    lines = {line.get_label(): line for line in drawn["reward.png"].axes[0].get_lines()}
    assert set(lines) == {"reward_mean, mean of 5 steps", "pass_at_1, mean of 5 steps", "eval accuracy",
                          "held-out before", "held-out after"}  # 40 steps: windows of max(5, 40 // 20) steps
    y = lines["reward_mean, mean of 5 steps"].get_ydata()
    assert np.isnan(y[:4]).all()  # no mean before 5 values exist
    assert np.allclose(y[4:], [np.mean(rewards[i - 4:i + 1]) for i in range(4, 40)])
    assert list(lines["eval accuracy"].get_ydata()) == [0.3, 0.4]
    text = write_report(tmp_path).read_text()
    table = text.split("## Held-out accuracy during the run")[1].split("##")[0]
    assert re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", table, re.M) == [
        ("0", "0.200", "0.250"), ("10", "0.300", "0.350"), ("20", "0.400", "0.450"), ("40", "0.500", "0.550")]


def test_a_short_run_has_no_smoothed_curve_and_a_run_without_evaluations_no_table(tmp_path):
    steps, evals, _ = read_metrics(_run(tmp_path, exgrpo=False) / "metrics.jsonl")
    labels = {line.get_label() for line in charts(steps, [], None)[0][2].axes[0].get_lines()}
    assert labels == {"reward_mean", "pass_at_1"}  # 5 steps: under two windows of 5
    assert held_out_table([], None, 5) == held_out_table([], {"before": None, "after": None}, 5) == []


def test_the_summary_and_the_final_table_carry_the_held_out_curve(tmp_path, capsys):
    from exgrpo_async.launcher.summary import print_summary
    from learner.shell import held_out_curve

    _, summary = _long_run(tmp_path)
    curve = held_out_curve(tmp_path / "metrics.jsonl", summary, 40)
    assert [(p["step"], p["accuracy"], p["greedy_accuracy"]) for p in curve] == [
        (0, 0.2, 0.25), (10, 0.3, 0.35), (20, 0.4, 0.45), (40, 0.5, 0.55)]
    assert held_out_curve(tmp_path / "metrics.jsonl", {"before": None, "after": None}, 40)[0]["step"] == 10
    totals = {"steps": 40, "rl_seconds": 1.0, "rollouts_per_s": 1.0, "tokens_per_s": 1.0, "sync_seconds_mean": 0.0,
              "stale_dropped": 0, "skipped_steps": 0, "final_model": "m"}
    print_summary({**summary, **totals, "held_out_curve": curve})
    assert "held-out sampled, by step".ljust(38) + "0: 0.200, 10: 0.300, 20: 0.400, 40: 0.500" in capsys.readouterr().out
    print_summary({**summary, **totals, "held_out_curve": [curve[0], curve[-1]]})  # before and after only
    assert "by step" not in capsys.readouterr().out


def test_the_report_quotes_the_paired_gain_when_the_summary_has_one(tmp_path):
    _long_run(tmp_path)
    assert "held-out gain" not in write_report(tmp_path).read_text()  # a summary without per-question figures
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["gain"] = {"sampled": 0.1, "sampled_se": 0.013, "sampled_questions": 1000,
                       "greedy": 0.08, "greedy_se": 0.014, "greedy_questions": 1000}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = write_report(tmp_path).read_text()
    assert "| held-out gain (sampled) ± paired standard error | +0.100 ± 0.013 over 1000 questions |" in text
    assert "| held-out gain (greedy) ± paired standard error | +0.080 ± 0.014 over 1000 questions |" in text
