"""How busy the machine's CPUs are while a command runs: /proc/stat sampled every few seconds.

Runs COMMAND, and every `--every` seconds reads the whole machine's CPU time (all cores, every
process) from /proc/stat; prints the mean share busy and how many samples fell under 60% and 25%, and
writes each sample to `--out` (JSON). A suite that leaves the CPUs idle a quarter of the time is
waiting (fixed waits, timeouts, process starts in a row), not computing (docs/history/benchmarks-notebook.md, the
suite's sixth pass).

    .venv/bin/python ops/bench/cpu_busy.py --out bench_out/cpu_busy.json -- ./.ci/run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path


def _cpu_times() -> tuple[int, int]:
    """(all jiffies, idle + iowait jiffies) since boot, over every core."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--out", default="bench_out/cpu_busy.json")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("no command given")
    proc = subprocess.Popen(command)
    t0, (total, idle), samples = time.monotonic(), _cpu_times(), []
    while proc.poll() is None:
        time.sleep(a.every)
        now_total, now_idle = _cpu_times()
        busy = 1.0 - (now_idle - idle) / max(1, now_total - total)
        samples.append({"t": round(time.monotonic() - t0, 1), "busy": round(busy, 4)})
        total, idle = now_total, now_idle
    busy = [s["busy"] for s in samples]
    summary = {"command": command, "returncode": proc.returncode, "seconds": time.monotonic() - t0,
               "samples": len(busy), "busy_mean": statistics.mean(busy) if busy else None,
               "under_60": sum(b < 0.60 for b in busy), "under_25": sum(b < 0.25 for b in busy)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "per_sample": samples}, indent=1))
    print(json.dumps(summary))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
