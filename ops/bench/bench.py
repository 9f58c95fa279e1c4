"""The benchmarks' shared helper: what every script of ops/bench/ begins and ends with.

The scripts are grouped by what they measure: learning/ (held-out accuracy and learning curves), system/ (the
system on CPU: transport, buffer, pipeline, memory, soak, the rank-exit stress) and gpu/ (the GPU check). Each
is run as a file (`.venv/bin/python ops/bench/GROUP/NAME.py ...`) and begins with the same two lines, which
find this module one folder up:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
    import bench  # noqa: E402

Importing it puts the repository's root on sys.path (the GPU check runs on a bare Python with nothing
installed; the others would find the installed packages without it). A test loads a script by path with
tests/bench.py `load_bench`, which also puts the script's group folder on sys.path for its siblings.
The end: `write_json` writes the result to `--out` (`add_out` gives the common default under bench_out/),
`target` prints a target's PASS/FAIL line, `exit_code` is 1 when a target failed (for the scripts that exit
non-zero then). tests/unit/test_bench_suite.py checks that every script keeps to this.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench_out"
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


def add_out(ap: argparse.ArgumentParser, default: str, help: str | None = None) -> None:
    """`--out`, by default bench_out/DEFAULT in the repository (a JSON file, or a folder where the script says)."""
    ap.add_argument("--out", default=str(OUT / default), help=help)


def write_json(path: str | Path, doc, indent: int | None = 2, say: bool = True, **dumps) -> Path:
    """`doc` as JSON at `path`, its folders made; prints "wrote PATH" unless `say` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, **dumps))
    if say:
        print(f"wrote {path}", flush=True)
    return path


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def target(text: str, ok: bool) -> bool:
    """Prints "TEXT -> PASS" (or FAIL) and returns `ok`."""
    print(f"{text} -> {verdict(ok)}", flush=True)
    return ok


def exit_code(*oks: bool) -> int:
    """0 when every target passed, else 1."""
    return 0 if all(oks) else 1
