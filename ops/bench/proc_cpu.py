"""CPU time per process of a command and everything it starts: where a test's or a run's core-seconds go.

Runs COMMAND and every `--every` seconds reads /proc/PID/stat (user + system time) and the command line
of every process that was not there before it started; at the end prints the wall time, the CPU seen
in all of them, the total per command line (first 110 characters) and the 12 largest processes. A
process's last sample is what counts, so one that lives shorter than `--every` is missed or undercounted.

    .venv/bin/python ops/bench/proc_cpu.py -- .venv/bin/python -m exgrpo_async.launcher.cli train \
        --config configs/qwen2.5-math-7b-8gpu.toml --rehearse learner.eval_before=false metrics.port=none
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import time

HZ = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[int, int, str]]:
    """pid -> (user + system jiffies, parent pid, command line) of every process readable now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
            cmd = open(f"/proc/{name}/cmdline").read().replace("\0", " ").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(name)] = (int(fields[11]) + int(fields[12]), int(fields[1]), cmd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("no command given")
    before = set(snapshot())
    proc = subprocess.Popen(command)
    seen: dict[int, tuple[int, int, str]] = {}
    t0 = time.monotonic()
    while proc.poll() is None:
        for pid, (jiffies, ppid, cmd) in snapshot().items():
            if pid not in before:
                # a process that is exiting shows an empty command line: keep the first one seen
                seen[pid] = (jiffies, ppid, (seen.get(pid, (0, 0, ""))[2] or cmd))
        time.sleep(a.every)
    print(f"wall {time.monotonic() - t0:.1f} s, CPU seen {sum(v[0] for v in seen.values()) / HZ:.1f} s "
          f"in {len(seen)} processes")
    by_cmd: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for jiffies, _, cmd in seen.values():
        by_cmd[cmd[:110]][0] += jiffies / HZ
        by_cmd[cmd[:110]][1] += 1
    for cmd, (cpu, n) in sorted(by_cmd.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"{cpu:7.1f} s  x{n:<3} {cmd}")
    print("largest processes:")
    for pid, (jiffies, ppid, cmd) in sorted(seen.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"{jiffies / HZ:7.1f} s  pid {pid} (parent {ppid})  {cmd[:90]}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
