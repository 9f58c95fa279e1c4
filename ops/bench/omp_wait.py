"""OpenMP's wait policy for a 2-thread torch process on a busy 2-core machine: the suite's case.

The suite's background toy build (2 torch threads) runs beside two pytest workers. With OpenMP's default
policy a thread that reaches a barrier first spins, and when the other thread has lost its core to
another process the spinning burns the core it waits for. This times the toy's warm start (a short
SFT, same seed: the same loss either way, so the policies differ in time only) four ways: idle and
beside `--busy` single-thread busy processes, each with the default policy and OMP_WAIT_POLICY=PASSIVE
(the setting ops/test and the suite's build use). Prints a table and writes JSON.

    .venv/bin/python ops/bench/omp_wait.py [--steps 120] [--busy 2] [--out bench_out/omp_wait.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUSY = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
while True:
    for _ in range(50):
        a = torch.tanh(a @ a)
    time.sleep(0.002)
"""
BUILD = ("import sys; from exgrpo_async.config_io import load_config; from exgrpo_async.runs import resolve_toy; "
         "resolve_toy(load_config(None, sys.argv[1:]))")


def build(steps: int, busy: int, policy: str | None) -> dict:
    """One toy build in a fresh cache beside `busy` busy processes; its SFT seconds, loss and wall."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        time.sleep(2 if busy else 0)
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.time()
            out = subprocess.run([sys.executable, "-c", BUILD, f"toy.cache_dir={cache}", f"toy.sft_steps={steps}"],
                                 cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
            wall = time.time() - t0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    m = re.search(r"(\d+) steps in (\d+)s, loss ([0-9.]+)", out)
    return {"busy": busy, "policy": policy or "default", "sft_s": int(m.group(2)), "loss": float(m.group(3)),
            "wall_s": round(wall, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--out", default="bench_out/omp_wait.json")
    a = ap.parse_args()
    rows = [build(a.steps, busy, policy) for busy in (a.busy, 0) for policy in (None, "PASSIVE")]
    print("| busy processes beside | OMP_WAIT_POLICY | SFT s | whole build s | final loss |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['busy']} | {r['policy']} | {r['sft_s']} | {r['wall_s']} | {r['loss']:.3f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"steps": a.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
