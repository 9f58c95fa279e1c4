"""Process helpers for the integration tests: the CLI command line, a process's descendants."""

from __future__ import annotations

import sys
from pathlib import Path


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "exgrpo_async.cli", *args]


def children_of(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        kids = (task / "children").read_text().split()
        for k in map(int, kids):
            out |= {k} | children_of(k)
    return out
