"""Experience-buffer cost: insert and sample time at 10^3..10^6 stored trajectories, bytes per stored token,
and (from a finished run's metrics.jsonl) trajectory-selection time as a share of the learner step.

- insert: `ExperienceBuffer.record` of one question's correct trajectories (4 per question), microseconds
  per trajectory, while filling the buffer to N trajectories (16-token trajectories: the cost does not
  depend on length, and 10^6 x 1000 tokens would need 8 GB);
- sample: `sample_questions(64)` plus fetching each chosen question's candidate list, median of 200
  calls, milliseconds (target <= 1 ms at 10^6 trajectories);
- bytes/token: tracemalloc growth while storing 2,000 trajectories of 1,000 tokens (target <= 10);
- selection share: mean `selection_seconds` / mean `step_seconds` over the mixed steps of a run
  (target <= 10% at the CPU demo's settings), when `--metrics RUN_DIR/metrics.jsonl` is given.

    .venv/bin/python ops/bench/system/buffer.py [--metrics runs/demo/run-*/metrics.jsonl] [--out bench_out/buffer.json]

(`--sizes` and `--bytes-trajectories` make it smaller: tests/unit/test_bench_system.py's tiny run; the targets
then speak of the largest size given.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from learner.maths.buffer import ExperienceBuffer, Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402

PER_QUESTION = 4


def fill(n_traj: int, length: int, seed: int = 0) -> tuple[ExperienceBuffer, float]:
    rng = np.random.default_rng(seed)
    buf = ExperienceBuffer(K=8, seed=seed)
    t0 = time.perf_counter()
    for q in range(n_traj // PER_QUESTION):
        ids = rng.integers(0, 150_000, (PER_QUESTION, length), dtype=np.int32)
        lps = rng.normal(size=(PER_QUESTION, length)).astype(np.float32)
        buf.record(q, 1 + q % 7, [Trajectory(ids[j], lps[j], 0) for j in range(PER_QUESTION)])
    return buf, (time.perf_counter() - t0) / max(1, buf.num_trajectories) * 1e6


def sample_ms(buf: ExperienceBuffer, n: int = 64, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chosen = buf.sample_questions(n)
        candidates = [buf.trajectories(q) for q in chosen]
        times.append(time.perf_counter() - t0)
        assert len(candidates) == n
    return statistics.median(times) * 1e3


def bytes_per_token(n_traj: int = 2000, length: int = 1000) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    buf, _ = fill(n_traj, length, seed=1)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / buf.num_tokens


def selection_share(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    mixed = [r for r in rows if r.get("exgrpo_mixed") and r.get("selection_seconds") is not None]
    if not mixed:
        raise SystemExit(f"{metrics} has no ExGRPO steps (run with exgrpo.enabled=true)")
    sel = statistics.mean(r["selection_seconds"] for r in mixed)
    step = statistics.mean(r["step_seconds"] for r in mixed)
    return {"steps": len(mixed), "selection_s": sel, "step_s": step, "share": sel / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_out(ap, "buffer.json")
    ap.add_argument("--metrics", help="a run's metrics.jsonl, for the selection share")
    ap.add_argument("--sizes", default="1000,10000,100000,1000000", help="stored trajectories, comma-separated")
    ap.add_argument("--bytes-trajectories", type=int, default=2000, help="1000-token trajectories for bytes/token")
    args = ap.parse_args()
    rows = []
    print(f"{'trajectories':>12} {'questions':>9} {'insert us/traj':>14} {'sample 64 ms':>12}")
    for n in (int(x) for x in args.sizes.split(",")):
        buf, ins = fill(n, 16)
        smp = sample_ms(buf)
        rows.append({"trajectories": buf.num_trajectories, "questions": buf.num_questions, "insert_us": ins,
                     "sample_ms": smp})
        print(f"{buf.num_trajectories:>12} {buf.num_questions:>9} {ins:>14.2f} {smp:>12.4f}")
        del buf
    bpt = bytes_per_token(args.bytes_trajectories)
    print(f"bytes per stored token (1000-token trajectories): {bpt:.2f}")
    ok_sample = bench.target(f"target sample(64) <= 1 ms at {rows[-1]['trajectories']:.0e}: "
                             f"{rows[-1]['sample_ms']:.4f} ms", rows[-1]["sample_ms"] <= 1.0)
    ok_bytes = bench.target(f"target <= 10 bytes/token: {bpt:.2f}", bpt <= 10.0)
    result = {"rows": rows, "bytes_per_token": bpt, "sample_pass": ok_sample, "bytes_pass": ok_bytes}
    if args.metrics:
        share = selection_share(Path(args.metrics))
        result["selection"] = share
        bench.target(f"selection {share['selection_s'] * 1e3:.1f} ms of a {share['step_s']:.2f} s step over "
                     f"{share['steps']} mixed steps = {share['share']:.1%} (target <= 10%)", share["share"] <= 0.10)
    bench.write_json(args.out, result)


if __name__ == "__main__":
    main()
