"""Where a whole command's Python time goes, by kind of process: a py-spy profile of every process the command
starts (`--subprocesses`), read back as each kind's share of the samples and, within it, the share spent
importing modules and starting vLLM engines. Made for the test suite, whose time is mostly real `train`
runs: an actor, a learner and their helpers are new Python processes each time, and what they import is
paid again each time.

    .venv/bin/pip install py-spy    # not a dependency: a profiler, only for this measurement
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) ops/avx2 .venv/bin/py-spy record -r 10 --subprocesses --format raw \
        -o bench_out/suite.raw -- env CI=true OMP_WAIT_POLICY=PASSIVE \
        .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder    # as ops/test runs it
    .venv/bin/python ops/bench/system/suite_profile.py bench_out/suite.raw [--rate 10] [--out FILE.json]

py-spy samples a thread that is running or waiting for a core (not one asleep in a system call), so on a
machine whose cores are all busy a share is of the time the processes wanted a core, not of core-seconds.
py-spy's default (blocking) sampling stops a process for each sample: a process killed with SIGKILL
while it is traced is not reaped until py-spy lets go of it (a test that waits for a killed actor's
replacement then times out); that is the profiler's, not the suite's.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402

# (kind, what its process's command line contains), first match wins; a pytest-xdist worker's command line
# has a `;`, which splits its process frame: its first part is matched
SPAWNED = "spawned helper (verifier worker, vLLM worker, rank, eval shard)"
KINDS = [("actor", "cli actor"), ("learner", "cli learner"), ("launcher or eval CLI", "cli train"),
         ("launcher or eval CLI", "cli eval"), (SPAWNED, "spawn_main"), ("pytest worker", "-u -c import sys")]
OTHER = "other (the GPU check, benchmarks, toy builds, pytest's controller)"


def kind_of(process_frame: str) -> str:
    return next((kind for kind, marker in KINDS if marker in process_frame), OTHER)


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one line per distinct stack, `frame;frame;... COUNT`; with --subprocesses the
    frames include `process PID:"COMMAND"`, the innermost of which names the process sampled."""
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def profile(stacks: list[tuple[list[str], int]], rate: float) -> dict:
    """Seconds sampled by kind of process, with each kind's process count and the shares of its samples
    inside an import (any `_find_and_load` frame) and, outside imports, inside a vLLM engine's start."""
    seconds, imports, engine_start = Counter(), Counter(), Counter()
    processes: dict[str, set[str]] = defaultdict(set)
    for frames, count in stacks:
        at = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        kind = kind_of(frames[at]) if at >= 0 else OTHER
        seconds[kind] += count / rate
        if at >= 0:
            processes[kind].add(frames[at].split(":", 1)[0])
        inner = ";".join(frames[at + 1:])
        if "_find_and_load" in inner:
            imports[kind] += count / rate
        elif "LLM.__init__" in inner or "VLLMEngine.__init__" in inner:
            engine_start[kind] += count / rate
    total = sum(seconds.values())
    kinds = {k: {"seconds": round(s, 1), "share": round(s / total, 3), "processes": len(processes[k]),
                 "imports_share": round(imports[k] / s, 3), "engine_start_share": round(engine_start[k] / s, 3)}
             for k, s in seconds.most_common()}
    return {"seconds": round(total, 1), "imports_share": round(sum(imports.values()) / total, 3) if total else 0.0,
            "engine_start_share": round(sum(engine_start.values()) / total, 3) if total else 0.0, "kinds": kinds}


def table(res: dict) -> list[str]:
    lines = [f"{res['seconds']:.0f} s sampled: {res['imports_share']:.0%} importing, "
             f"{res['engine_start_share']:.0%} starting vLLM engines",
             "| kind of process | processes | seconds sampled | share | importing | starting engines |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {v['processes']} | {v['seconds']:.0f} | {v['share']:.0%} | {v['imports_share']:.0%} | "
              f"{v['engine_start_share']:.0%} |" for k, v in res["kinds"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="py-spy's --format raw output")
    ap.add_argument("--rate", type=float, default=10.0, help="the samples per second py-spy was given (-r)")
    bench.add_out(ap, "suite-profile.json", "the figures as JSON")
    a = ap.parse_args(argv)
    res = profile(read_raw(a.raw), a.rate)
    print("\n".join(table(res)))
    bench.write_json(a.out, res, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
