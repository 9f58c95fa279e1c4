"""Monitoring overhead: what Prometheus export costs the learner and an actor, per event and per scrape.

- learner step: `LearnerMetrics.observe_step` on a real metrics.jsonl row (ExGRPO fields, a staleness
  histogram of B groups), microseconds, median of 2,000 calls; compared with the step it describes;
- actor group: `observe_verify` (K statuses and latencies) + `observe_sent` per group, microseconds;
  compared with the generation time of one group in the CPU demo (rollouts/s of the run);
- scrape: one HTTP GET of each endpoint's /metrics (bytes, milliseconds, median of 50), with 8
  buckets populated, as Prometheus does every scrape_interval.

    .venv/bin/python ops/bench/system/metrics.py [--metrics runs/demo/run-*/metrics.jsonl] [--out bench_out/metrics.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from actors.metrics import ActorMetrics
from exgrpo_async.rollout import Completion, RolloutGroup
from learner.metrics import LearnerMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402

K = 8
ROW = {  # a CPU-demo ExGRPO row (B=32 groups of K=8)
    "step": 50, "policy_version": 50, "reward_mean": 0.3, "pass_at_1": 0.3, "loss": -0.01, "grad_norm": 0.2,
    "tokens_generated": 9000, "rollouts": 256, "staleness_mean": 0.6, "staleness_max": 1,
    "staleness_hist": {"0": 13, "1": 19}, "sync_seconds": 0.006, "publish_seconds": 0.001, "step_seconds": 1.4,
    "wait_seconds": 0.2, "train_seconds": 1.1, "ratio_mean": 1.0, "ratio_max": 1.3, "clip_frac": 0.01,
    "is_weight_mean": 1.0, "is_weight_max": 1.8, "is_truncated_frac": 0.001, "mismatch_kl": 1e-5,
    "behaviour_kl": 1e-3, "truncated_frac": 0.0, "actor_idle_frac": 0.1, "skipped_steps_total": 0,
    "optimizer_updates_total": 100, "stale_dropped_total": 3, "bad_messages_total": 0, "verify_timeouts_total": 0,
    "verify_errors_total": 0, "actors": 2, "rollouts_per_s": 180.0, "tokens_per_s": 6300.0, "exgrpo_mixed": True,
    "buffer_questions": 400, "buffer_trajectories": 1500, "buffer_tokens": 50000, "buffer_bytes": 424000,
    "retired_total": 90, "buckets": {str(k): 50 for k in range(1, K)}, "experience_questions": 8,
    "experience_by_bucket": {"3": 2, "4": 4, "5": 2}, "selected_entropy_mean": 0.2, "replay_w_mean": 1.0,
    "replay_w_max": 1.4, "replay_token_frac": 0.03, "selection_seconds": 0.02,
}


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def scrape(port: int, n: int = 50) -> tuple[int, float]:
    size, times = 0, []
    for _ in range(n):
        t0 = time.perf_counter()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        times.append(time.perf_counter() - t0)
        size = len(body)
    return size, statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_out(ap, "metrics.json")
    ap.add_argument("--metrics", help="a run's metrics.jsonl: compare with its mean step time and rollouts/s")
    args = ap.parse_args()
    step_s, group_s = ROW["step_seconds"], K / ROW["rollouts_per_s"]
    if args.metrics:
        rows = [json.loads(x) for x in Path(args.metrics).read_text().splitlines() if '"eval"' not in x]
        step_s = statistics.mean(r["step_seconds"] for r in rows)
        group_s = K / rows[-1]["rollouts_per_s"]

    learner = LearnerMetrics("127.0.0.1", 0, max_staleness=1)
    learner.watch_live(lambda: 2, lambda: 10, lambda: 16)
    step_us = median_us(lambda: learner.observe_step(ROW, {"hellos": 2}), 2000)
    learner_scrape = scrape(learner.port)
    learner.close()

    actor = ActorMetrics("127.0.0.1", 0)
    comps = [Completion(np.zeros(35, np.int32), np.zeros(35, np.float32), 1.0, "stop", "ok") for _ in range(K)]
    group = RolloutGroup(1, 0, np.zeros(20, np.int32), comps, 1, "actor-1", "train", 0.1, {})
    statuses, lat = ["ok"] * K, [0.0005] * K
    group_us = median_us(lambda: (actor.observe_verify(statuses, lat), actor.observe_sent(group)), 2000)
    actor_scrape = scrape(actor.endpoint.port)
    actor.close()

    result = {
        "learner_observe_step_us": step_us, "step_seconds": step_s, "learner_share": step_us * 1e-6 / step_s,
        "actor_observe_group_us": group_us, "group_seconds": group_s, "actor_share": group_us * 1e-6 / group_s,
        "learner_scrape_bytes": learner_scrape[0], "learner_scrape_ms": learner_scrape[1],
        "actor_scrape_bytes": actor_scrape[0], "actor_scrape_ms": actor_scrape[1],
    }
    print(f"{'what':34s}{'cost':>12s}{'compared with':>16s}{'share':>10s}")
    print(f"{'learner observe_step':34s}{step_us:>10.0f}us{step_s:>14.2f} s{result['learner_share']:>10.2e}")
    print(f"{'actor observe per group (K=8)':34s}{group_us:>10.0f}us{group_s * 1e3:>13.1f} ms{result['actor_share']:>10.2e}")
    print(f"{'learner scrape':34s}{learner_scrape[1]:>10.2f}ms{learner_scrape[0]:>12d} B")
    print(f"{'actor scrape':34s}{actor_scrape[1]:>10.2f}ms{actor_scrape[0]:>12d} B")
    bench.write_json(args.out, result)


if __name__ == "__main__":
    main()
