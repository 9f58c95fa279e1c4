"""Process helpers for the integration tests: the CLI command line, a process's descendants."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "exgrpo_async.launcher.cli", *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> set[int]:
    """Every descendant of `pid` now (a process or thread that exits while this reads is skipped)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for k in map(int, kids):
            out |= {k} | children_of(k)
    return out


def actor_pids(launcher_pid: int) -> list[int]:
    """The `exgrpo-async actor` processes below a launcher, oldest pid first."""
    pids = []
    for pid in children_of(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"actor" in cmd and b"exgrpo_async.launcher.cli" in cmd:
            pids.append(pid)
    return sorted(pids)


def log_excerpt(path: Path, tail: int = 3000) -> str:
    """A failed run's log for an assertion message: the first traceback of every process (a follower
    rank's error comes long before the lead's tail), then the log's last `tail` characters."""
    lines = path.read_text(errors="replace").splitlines()
    firsts, seen = [], set()
    for i, line in enumerate(lines):
        who = line.split("]", 1)[0] if line.startswith("[rank") else line.split(" ", 1)[0]
        if "Traceback (most recent call last)" in line and who not in seen:
            seen.add(who)
            firsts.append("\n".join(lines[i:i + 60]))
    head = "".join(f"\n--- a first traceback ---\n{t}" for t in firsts)
    return head + "\n--- log tail ---\n" + "\n".join(lines)[-tail:]


def kill_tree(proc) -> None:
    """Kill a still-running process and all its descendants (a failed test must leave no run behind);
    stopped ones are continued first, so they can die."""
    import os
    import signal

    if proc.poll() is not None:
        return
    for pid in [*children_of(proc.pid), proc.pid]:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
    proc.wait(timeout=60)
