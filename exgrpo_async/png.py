"""Small raster charts written as PNG with numpy and zlib: the run report's plots, no plotting dependency.

Three chart kinds (lines, stacked areas, bars) on a white canvas with a frame, "nice" ticks, a title
and a legend, text drawn with an embedded 5x7 bitmap font (lower case drawn as capitals). Missing
values (None, NaN) are gaps in a line. Enough for a report a person reads; not a plotting library.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

W, H = 800, 400
LEFT, RIGHT, TOP, BOTTOM = 80, 20, 64, 48  # plot-area margins: ticks left and below, title and legend above
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
GRID, AXIS, TEXT = (225, 225, 225), (60, 60, 60), (20, 20, 20)

# 5x7 glyphs: 7 rows of 5 bits (bit 4 = leftmost column), as 14 hex digits
_FONT = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C", "A": "0E1111111F1111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F", "F": "1F10101E101010",
    "G": "0E11101711110F", "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C",
    "K": "11121418141211", "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D", "R": "1E11111E141211",
    "S": "0F10100E01011E", "T": "1F040404040404", "U": "1111111111110E", "V": "11111111110A04",
    "W": "1111111515150A", "X": "11110A040A1111", "Y": "1111110A040404", "Z": "1F01020408101F",
    " ": "00000000000000", ".": "00000000000C0C", ",": "000000000C0408", "-": "0000001F000000",
    "+": "0004041F040400", "_": "0000000000001F", "/": "00010204081000", ":": "000C0C000C0C00",
    "%": "18190204081303", "(": "02040808080402", ")": "08040202020408", "=": "00001F001F0000",
    "@": "0E11010D15150E", "'": "0C040800000000", "[": "0E08080808080E", "]": "0E02020202020E",
    "<": "02040810080402", ">": "08040201020408", "|": "04040404040404", "*": "0004150E150400",
    "#": "0A0A1F0A1F0A0A", "?": "0E110102040004", "!": "04040404040004", "&": "0C12140815120D",
}


def glyph(ch: str) -> np.ndarray:
    """(7, 5) bool bitmap of a character; unknown characters are drawn as '?'."""
    code = _FONT.get(ch.upper(), _FONT["?"])
    rows = [int(code[i:i + 2], 16) for i in range(0, 14, 2)]
    return np.array([[(r >> (4 - c)) & 1 for c in range(5)] for r in rows], dtype=bool)


def text_width(s: str, scale: int = 1) -> int:
    return len(s) * 6 * scale


def draw_text(img: np.ndarray, x: int, y: int, s: str, colour=TEXT, scale: int = 1) -> None:
    """Text with its top-left corner at (x, y); clipped at the image edges."""
    for i, ch in enumerate(s):
        g = np.kron(glyph(ch), np.ones((scale, scale), dtype=bool))
        x0 = x + i * 6 * scale
        ys, xs = np.nonzero(g)
        ys, xs = ys + y, xs + x0
        ok = (ys >= 0) & (ys < img.shape[0]) & (xs >= 0) & (xs < img.shape[1])
        img[ys[ok], xs[ok]] = colour


def write_png(path: Path, rgb: np.ndarray) -> None:
    """8-bit RGB PNG: one IDAT, filter 0 on every row."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.astype(np.uint8).reshape(h, w * 3)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t / step) * step)
        t += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def fmt(v: float) -> str:
    """Compact tick label: 0, 0.25, 12, 1.2k, 35k, 3e-05."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e4:
        return f"{v / 1e3:.0f}k"
    if a >= 1e3:
        return f"{v / 1e3:.1f}k"
    if a < 1e-3:
        return f"{v:.0e}"
    return f"{v:.4g}"


class _Canvas:
    """A plot area mapping data (x, y) to pixels, with axes, ticks and a title drawn."""

    def __init__(self, title: str, xlabel: str, ylabel: str, xr: tuple[float, float], yr: tuple[float, float],
                 x_ticks: bool = True):
        self.img = np.full((H, W, 3), 255, np.uint8)
        self.x0, self.x1, self.y0, self.y1 = LEFT, W - RIGHT, TOP, H - BOTTOM
        self.xt, self.yt = nice_ticks(*xr), nice_ticks(*yr)
        self.xr, self.yr = (self.xt[0], self.xt[-1]), (self.yt[0], self.yt[-1])
        img = self.img
        for t in self.yt:
            y = self.py(t)
            img[y, self.x0:self.x1] = GRID
            draw_text(img, self.x0 - 6 - text_width(fmt(t)), y - 3, fmt(t))
        for t in self.xt if x_ticks else []:  # bar charts label their bars instead
            x = self.px(t)
            img[self.y0:self.y1, x] = GRID
            draw_text(img, x - text_width(fmt(t)) // 2, self.y1 + 6, fmt(t))
        img[self.y0:self.y1 + 1, self.x0] = img[self.y0:self.y1 + 1, self.x1] = AXIS
        img[self.y0, self.x0:self.x1 + 1] = img[self.y1, self.x0:self.x1 + 1] = AXIS
        draw_text(img, (W - text_width(title, 2)) // 2, 8, title, scale=2)
        draw_text(img, (self.x0 + self.x1 - text_width(xlabel)) // 2, H - 16, xlabel)
        draw_text(img, 4, self.y0 - 14, ylabel)

    def px(self, x: float) -> int:
        return int(round(self.x0 + (x - self.xr[0]) / ((self.xr[1] - self.xr[0]) or 1) * (self.x1 - self.x0)))

    def py(self, y: float) -> int:
        return int(round(self.y1 - (y - self.yr[0]) / ((self.yr[1] - self.yr[0]) or 1) * (self.y1 - self.y0)))

    def legend(self, names: list[str]) -> None:
        x, y = self.x0, 34
        for i, name in enumerate(names):
            self.img[y:y + 8, x:x + 14] = COLOURS[i % len(COLOURS)]
            draw_text(self.img, x + 18, y, name)
            x += 18 + text_width(name) + 16

    def segment(self, a: tuple[int, int], b: tuple[int, int], colour) -> None:
        n = 2 * max(abs(b[0] - a[0]), abs(b[1] - a[1])) + 1
        xs = np.rint(np.linspace(a[0], b[0], n)).astype(int)
        ys = np.rint(np.linspace(a[1], b[1], n)).astype(int)
        for dx in (0, 1):
            for dy in (0, 1):  # 2 px thick
                self.img[np.clip(ys + dy, 0, H - 1), np.clip(xs + dx, 0, W - 1)] = colour


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _range(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if _finite(v)]
    return (min(vals), max(vals)) if vals else (0.0, 1.0)


def line_chart(path: Path, title: str, series: dict[str, tuple[list, list]], xlabel: str = "step",
               ylabel: str = "") -> None:
    """One line per series {name: (xs, ys)}; None/NaN in ys breaks the line; a lone point is a dot."""
    xs_all = [x for xs, _ in series.values() for x in xs]
    ys_all = [y for _, ys in series.values() for y in ys]
    c = _Canvas(title, xlabel, ylabel, _range(xs_all), _range(ys_all))
    for i, (xs, ys) in enumerate(series.values()):
        colour, prev = COLOURS[i % len(COLOURS)], None
        for x, y in zip(xs, ys):
            if not (_finite(x) and _finite(y)):
                prev = None
                continue
            p = (c.px(x), c.py(y))
            c.segment(prev or p, p, colour)
            if prev is None:  # a point with no neighbour still shows
                c.img[max(0, p[1] - 2):p[1] + 3, max(0, p[0] - 2):p[0] + 3] = colour
            prev = p
    c.legend(list(series))
    write_png(path, c.img)


def stacked_area_chart(path: Path, title: str, xs: list[float], layers: dict[str, list[float]],
                       xlabel: str = "step", ylabel: str = "") -> None:
    """Layers stacked bottom-up in the given order, each filled between its lower and upper boundary."""
    tops = np.cumsum(np.array([[v if _finite(v) else 0.0 for v in ys] for ys in layers.values()], float), axis=0)
    c = _Canvas(title, xlabel, ylabel, _range(xs), (0.0, float(tops.max()) if tops.size else 1.0))
    cols = np.arange(c.x0 + 1, c.x1)
    xdata = c.xr[0] + (cols - c.x0) / (c.x1 - c.x0) * (c.xr[1] - c.xr[0])
    order = np.argsort(xs)
    xs_sorted = np.asarray(xs, float)[order]
    inside = (xdata >= xs_sorted[0]) & (xdata <= xs_sorted[-1])
    lower = np.zeros(len(cols))
    for i in range(tops.shape[0]):
        upper = np.interp(xdata, xs_sorted, tops[i][order])
        for j in np.nonzero(inside)[0]:
            ya, yb = c.py(upper[j]), c.py(lower[j])
            if yb > ya:
                c.img[ya:yb, cols[j]] = COLOURS[i % len(COLOURS)]
        lower = upper
    c.legend(list(layers))
    write_png(path, c.img)


def bar_chart(path: Path, title: str, labels: list[str], values: list[float], xlabel: str = "",
              ylabel: str = "") -> None:
    """One bar per label, left to right, labels under the bars."""
    c = _Canvas(title, xlabel, ylabel, (0.0, 1.0), (0.0, max(values, default=1.0) or 1.0), x_ticks=False)
    slot = (c.x1 - c.x0) / max(1, len(values))
    for i, (label, v) in enumerate(zip(labels, values)):
        xa, xb = int(c.x0 + i * slot + slot * 0.15), int(c.x0 + (i + 1) * slot - slot * 0.15)
        c.img[c.py(v):c.y1, xa:max(xa + 1, xb)] = COLOURS[0]
        draw_text(c.img, (xa + xb - text_width(label)) // 2, c.y1 + 6, label)
    write_png(path, c.img)
