"""Slow every core of this machine to a share of its speed, as a slower CPU's clock would: one process per
core, pinned to it, at real-time priority, takes (1 - SPEED) of each PERIOD and gives the rest back.
Every thread on that core, however many, then gets SPEED of its time; a cgroup's CPU quota would not do
that (one thread alone would run at full speed under a quota of two cores' worth).

    python3 ops/slow_cores.py 0.75 &    # until killed (SIGTERM); ops/avx2 --speed starts and stops it
    .venv/bin/python ops/slow_cores.py --speed-for 291    # prints the speed that brings the pace to 291, and the pace

The pace reference (`pace`): one thread's 512x512 fp32 matrix products per second, with torch, under the
caps the environment sets. This machine's own pace moves by up to 2x from hour to hour (docs/benchmarks.md);
`ops/avx2 --pace 291` measures it under the AVX2 caps and slows the cores to the AVX2-only EPYC's (291),
where `--speed 0.75` brings only an ordinary hour's pace there.

ops/avx2 uses it to bring a fast machine's AVX2-capped figures to an AVX2-only EPYC's (docs/benchmarks.md,
"Two classes of CPU"). Root only (SCHED_FIFO); real-time tasks stay under the kernel's 95% cap.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PERIOD_S = 0.002  # short against a learner step (about 1 s) and a decode step (a few ms)


def hold(core: int, speed: float) -> None:
    """On `core`, spin (1 - speed) of every period at SCHED_FIFO priority 1 and sleep the rest, forever."""
    os.sched_setaffinity(0, {core})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    busy = (1.0 - speed) * PERIOD_S
    start = time.perf_counter()
    n = 0
    while True:
        n += 1
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        wake = start + n * PERIOD_S  # a fixed schedule: the share does not drift with late wake-ups
        time.sleep(max(0.0, wake - time.perf_counter()))


def pace(seconds: float = 3.0) -> float:
    """Matrix products (512x512, fp32, one thread) per second over `seconds`, after 20 to warm up."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    for _ in range(20):
        a @ a
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        n += 1
    return n / (time.perf_counter() - start)


def speed_for(target: float, measured: float) -> float:
    """The share of each core that brings a pace of `measured` to `target`: 1.0 (not slowed) when the
    machine is at or under the target already, never under slow_cores' floor of 0.1."""
    return max(0.1, min(1.0, round(target / measured, 3)))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--speed-for":
        measured = pace()
        print(f"{speed_for(float(argv[1]), measured)} {measured:.0f}")
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    speed = float(argv[0])
    if not 0.1 <= speed < 1.0:
        print(f"slow_cores: SPEED must be in [0.1, 1), got {speed}", file=sys.stderr)
        return 2
    children, parent = [], os.getpid()
    for core in sorted(os.sched_getaffinity(0)):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the parent
            if os.getppid() != parent:
                os._exit(0)
            hold(core, speed)
        children.append(pid)

    def stop(*_):
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
