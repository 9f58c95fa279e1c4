"""Slow every core of this machine to a share of its speed, as a slower CPU's clock would: one process per
core, pinned to it, at real-time priority, takes (1 - SPEED) of each PERIOD and gives the rest back.
Every thread on that core, however many, then gets SPEED of its time; a cgroup's CPU quota would not do
that (one thread alone would run at full speed under a quota of two cores' worth).

    python3 ops/slow_cores.py 0.75 &    # until killed (SIGTERM); ops/avx2 --speed starts and stops it

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


def main(argv: list[str]) -> int:
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
