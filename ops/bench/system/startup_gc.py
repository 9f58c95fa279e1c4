"""Start-up without the garbage collector: each role's start-up imports with Python's cyclic collector on, and
inside exgrpo_async/startup.py `without_gc()`, side by side.

For each role (what its process imports before it works: an actor torch, its loop and vLLM's two engine
classes; a learner rank torch, transformers and the learner's modules; a verifier worker math-verify and its
warm-up), each way, `--repeats` fresh processes, alternating: the CPU seconds of the start-up block (with
`without_gc`, its closing young-generation pass and freeze included), then the CPU seconds of one full
collection after it, which every later full collection of the run costs at least (a frozen start-up is not
scanned again). Medians, and the ratio of the two ways.

    .venv/bin/python ops/bench/system/startup_gc.py [--repeats 5] [--roles actor,learner,verifier]
        [--out bench_out/startup_gc.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402

# each role's start-up, written out (the roles' own functions call without_gc themselves)
ROLES = {
    "actor": "import torch\nfrom actors.loop import run\nfrom vllm import LLM\n"
             "from vllm.v1.engine.async_llm import AsyncLLM",
    "learner": "import torch\nimport torch.distributed\nimport learner.main\nimport learner.train\n"
               "import learner.policy",
    "verifier": "from actors.verifier import score_answer\nscore_answer('\\\\boxed{1}', '1', False)",
}
CHILD = """
import gc, json, sys, time
from exgrpo_async.startup import without_gc
code, way = sys.argv[1], sys.argv[2]
t = time.process_time()
if way == "without_gc":
    with without_gc():
        exec(code)
else:
    exec(code)
block = time.process_time() - t
t = time.process_time()
gc.collect()
print(json.dumps({"block_s": block, "full_collection_s": time.process_time() - t, "modules": len(sys.modules)}))
"""


def measure(code: str, way: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, code, way], capture_output=True, text=True, cwd=REPO,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--roles", default=",".join(ROLES))
    bench.add_out(ap, "startup_gc.json")
    args = ap.parse_args()
    res = {"repeats": args.repeats, "roles": {}}
    print(f"{'role':9} {'way':11} {'start-up s':>10} {'full gc s':>9} {'modules':>7}")
    for role in args.roles.split(","):
        runs: dict[str, list[dict]] = {"gc_on": [], "without_gc": []}
        for _ in range(args.repeats):
            for way in runs:
                runs[way].append(measure(ROLES[role], way))
        row = {}
        for way, got in runs.items():
            row[way] = {k: statistics.median(r[k] for r in got) for k in ("block_s", "full_collection_s", "modules")}
            print(f"{role:9} {way:11} {row[way]['block_s']:10.2f} {row[way]['full_collection_s']:9.3f} "
                  f"{row[way]['modules']:7.0f}")
        row["block_ratio"] = row["without_gc"]["block_s"] / row["gc_on"]["block_s"]
        print(f"{role:9} without_gc / gc_on: {row['block_ratio']:.2f} of the start-up's CPU")
        res["roles"][role] = row
    bench.write_json(args.out, res)


if __name__ == "__main__":
    main()
