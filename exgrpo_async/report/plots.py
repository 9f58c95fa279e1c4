"""Charts for the run report and the learning benchmark, drawn with matplotlib (Agg, no pyplot state).

Lines (None and NaN are gaps), lines with a min..max band (a mean over seeds), stacked areas and bars.
Series that coincide stay visible: each has its own colour, dash pattern and marker, and the earlier
ones are drawn wider and underneath. A series with at most SPARSE points (held-out evaluations, a toy
run) gets markers; a single point, or a point between gaps, is a marker. The legend sits outside the
axes and constrained layout keeps every label inside the figure. A chart is a `Figure`: the caller
saves it with `save`, a test reads its artists back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

SIZE = (8.0, 4.0)  # inches; at DPI, an 800x400 PNG
DPI = 100
DASHES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
SPARSE = 40  # a series of at most this many points is drawn with markers

Values = Sequence[float | int | None]
Series = tuple[Values, Values]  # (x, y)


def as_floats(values: Values) -> np.ndarray:
    """Values as a float array, None as NaN."""
    return np.array([np.nan if v is None else float(v) for v in values], dtype=float)


def figure(ncols: int = 1, size: tuple[float, float] = SIZE) -> tuple[Figure, list[Axes]]:
    """A figure with one row of ncols axes (sharing x), a grid on each, laid out by constrained layout."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, ncols, sharex=True, squeeze=False)[0])
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, axes


def draw_lines(ax: Axes, series: Mapping[str, Series]) -> None:
    """One Line2D per series {label: (x, y)}, each in its own colour, dash pattern and marker; markers
    after the first series are hollow, so points that coincide show both."""
    for i, (label, (x, y)) in enumerate(series.items()):
        xs, ys = as_floats(x), as_floats(y)
        ok = np.isfinite(xs) & np.isfinite(ys)
        style = {"color": f"C{i % 10}", "label": label, "zorder": 2 + i, "marker": MARKERS[i % len(MARKERS)],
                 "markerfacecolor": "none" if i else f"C{i % 10}", "markeredgewidth": 1.5}
        if ok.sum() <= 1:  # one value: a point, not a line
            ax.plot(xs[ok], ys[ok], linestyle="none", markersize=9, **style)
            continue
        lone = ok & ~np.r_[False, ok[:-1]] & ~np.r_[ok[1:], False]
        markevery = None if ok.sum() <= SPARSE else list(lone)
        if markevery is not None and not lone.any():
            style["marker"] = None
        ax.plot(xs, ys, linestyle=DASHES[i % len(DASHES)], linewidth=max(2.8 - 0.5 * i, 1.2), markersize=7,
                markevery=markevery, **style)


def integer_x(ax: Axes) -> None:
    """Integer ticks on x (steps); a single x gets a unit of room either side."""
    lo, hi = ax.dataLim.intervalx
    if np.isfinite(lo) and hi - lo < 2:
        ax.set_xlim(lo - 1, hi + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_bands(ax: Axes, x: Values, runs: Mapping[str, Sequence[Values]]) -> None:
    """Per label, the mean over its runs (each a curve over x) as a line and their min..max as a band."""
    arrays = {label: np.array([as_floats(r) for r in curves]) for label, curves in runs.items()}
    draw_lines(ax, {label: (x, list(a.mean(axis=0))) for label, a in arrays.items()})
    for line, a in zip(ax.get_lines()[-len(arrays):], arrays.values()):
        ax.fill_between(as_floats(x), a.min(axis=0), a.max(axis=0), color=line.get_color(), alpha=0.15, linewidth=0)


def finish(fig: Figure, title: str, xlabel: str = "", ylabel: str = "", reverse_legend: bool = False) -> Figure:
    """Title, axis labels where given (the y label on the first axes) and a legend of the first axes'
    artists, outside the axes."""
    axes = fig.get_axes()
    fig.suptitle(title)
    if xlabel:
        for ax in axes:
            ax.set_xlabel(xlabel)
    if ylabel:
        axes[0].set_ylabel(ylabel)
    handles, labels = axes[0].get_legend_handles_labels()
    if reverse_legend:
        handles, labels = handles[::-1], labels[::-1]
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    return fig


def line_chart(title: str, series: Mapping[str, Series], xlabel: str = "step", ylabel: str = "") -> Figure:
    """Lines over an integer x (steps); see draw_lines."""
    fig, (ax,) = figure()
    draw_lines(ax, series)
    integer_x(ax)
    return finish(fig, title, xlabel, ylabel)


def stacked_area_chart(title: str, x: Values, layers: Mapping[str, Values], xlabel: str = "step",
                       ylabel: str = "") -> Figure:
    """Layers stacked bottom-up in the given order (an ordinal colour map; None counts 0); a single x is a
    stacked bar. The legend lists the top layer first, as stacked."""
    fig, (ax,) = figure()
    xs = as_floats(x)
    ys = [np.nan_to_num(as_floats(v)) for v in layers.values()]
    colours = colormaps["viridis"](np.linspace(0.1, 0.9, len(ys)))
    if len(xs) == 1:
        bottoms = np.cumsum([0.0] + [y[0] for y in ys])
        for label, y, bottom, colour in zip(layers, ys, bottoms, colours):
            ax.bar(xs, y, bottom=bottom, width=0.5, color=colour, label=label)
    else:
        ax.stackplot(xs, *ys, labels=list(layers), colors=colours, alpha=0.9)
        ax.set_xlim(xs.min(), xs.max())
    integer_x(ax)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return finish(fig, title, xlabel, ylabel, reverse_legend=True)


def bar_chart(title: str, labels: Sequence[str], values: Sequence[float], xlabel: str = "",
              ylabel: str = "") -> Figure:
    """One bar per label, left to right, its value written on it."""
    fig, (ax,) = figure()
    at = range(len(labels))  # positions, not categorical units (labels such as "0" would be parsed)
    bars = ax.bar(at, list(values), color="C0", zorder=2)
    ax.grid(axis="x", visible=False)
    ax.set_xticks(at, list(labels))
    ax.bar_label(bars, fontsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return finish(fig, title, xlabel, ylabel)


def save(fig: Figure, path: Path) -> Path:
    """Write the figure as a PNG at DPI; returns the path."""
    fig.savefig(path, dpi=DPI)
    return Path(path)
