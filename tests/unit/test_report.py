"""The run report: valid PNGs with what was drawn on them, round ticks, and a report.md that references
every plot, counts unreadable metrics lines and says what it could not plot."""

import json
import re
import struct
import zlib

import numpy as np
import pytest

from exgrpo_async.png import COLOURS, glyph, line_chart, nice_ticks, write_png
from exgrpo_async.report import write_report


def read_png(path) -> np.ndarray:
    """Decode our own PNGs (8-bit RGB, filter 0) independently of the writer, checking every CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_round_trips(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    write_png(tmp_path / "x.png", img)
    assert (read_png(tmp_path / "x.png") == img).all()


def test_glyphs_are_distinct_and_case_insensitive():
    chars = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.-_/:%()=@"
    bitmaps = {glyph(c).tobytes() for c in chars}
    assert len(bitmaps) == len(chars)
    assert (glyph("a") == glyph("A")).all() and glyph(" ").sum() == 0 and glyph("8").sum() > glyph("1").sum()


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (0.137, 0.52), (3.0, 3.0), (0.0, 0.0), (-5.0, 1e5), (1e-6, 3e-5)])
def test_nice_ticks_cover_the_range_with_round_steps(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 12
    steps = np.diff(ticks)
    assert np.allclose(steps, steps[0])
    mantissa = steps[0] / 10 ** np.floor(np.log10(steps[0]))
    assert any(np.isclose(mantissa, m) for m in (1, 2, 5, 10))


def test_line_chart_draws_each_series_in_its_colour_with_gaps(tmp_path):
    line_chart(tmp_path / "c.png", "Two series", {"a": ([1, 2, 3, 4], [0.1, None, 0.3, 0.4]),
                                                  "b": ([1, 2, 3, 4], [5.0, 4.0, float("nan"), 2.0])})
    img = read_png(tmp_path / "c.png")
    for colour in COLOURS[:2]:
        assert (img == colour).all(axis=-1).sum() > 100, colour
    assert not (img == COLOURS[2]).all(axis=-1).any()  # no third series


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


def test_report_of_an_exgrpo_run_has_every_plot(tmp_path):
    path = write_report(_run(tmp_path, exgrpo=True))
    text = path.read_text()
    assert path == tmp_path / "ex" / "report" / "report.md"
    pngs = re.findall(r"^!\[[^\]]*\]\(([^)]+)\)$", text, re.M)
    assert {"reward.png", "buffer.png", "staleness.png", "staleness_hist.png", "weights.png",
            "rollouts_per_s.png", "step_time.png"} <= set(pngs)
    for name in pngs:
        assert read_png(path.parent / name).shape == (400, 800, 3)
    assert "1 unreadable line(s)" in text and "5 learner steps" in text and "No summary.json" in text
    bars = read_png(path.parent / "staleness_hist.png")
    assert (bars == COLOURS[0]).all(axis=-1).sum() > 1000  # two bars of 10 groups each


def test_report_without_exgrpo_says_why_the_buffer_is_missing(tmp_path):
    path = write_report(_run(tmp_path, exgrpo=False))
    assert "exgrpo.enabled=false" in path.read_text() and not (path.parent / "buffer.png").exists()


def test_report_of_a_run_without_steps_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="no learner step recorded yet \\(1 unreadable"):
        write_report(tmp_path)
