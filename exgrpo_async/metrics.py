"""Prometheus export of the learner's per-step metrics (the same figures as metrics.jsonl).

One registry per process, served by prometheus-client's HTTP server on `metrics.host:metrics.port`
(127.0.0.1 by default; port 0 picks a free one, written to RUN_DIR/learner.json). Names follow
Prometheus conventions: an `exgrpo_` prefix, `_total` for counters, base units (`_seconds`).
The learner calls `observe_step(row)` with each metrics.jsonl row; nothing here is on a hot path.
Actor-side metrics and the full catalog are issue 5 (docs/metrics.md lists what exists).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

# metrics.jsonl field -> (gauge name, help); counters and labelled series are handled below
_GAUGES = {
    "policy_version": ("exgrpo_learner_policy_version", "Policy version after the latest learner step."),
    "reward_mean": ("exgrpo_learner_reward_mean", "Mean verifier reward of the latest batch."),
    "pass_at_1": ("exgrpo_learner_pass_at_1", "Fraction of correct completions in the latest batch."),
    "step_seconds": ("exgrpo_learner_step_seconds", "Wall time of the latest learner step."),
    "train_seconds": ("exgrpo_learner_train_seconds", "Forward/backward/optimizer time of the latest step."),
    "wait_seconds": ("exgrpo_learner_wait_seconds", "Time the latest step waited for rollouts."),
    "staleness_mean": ("exgrpo_learner_staleness_mean", "Mean policy-version lag of the latest batch."),
    "staleness_max": ("exgrpo_learner_staleness_max", "Largest policy-version lag in the latest batch."),
    "grad_norm": ("exgrpo_learner_grad_norm", "Largest pre-clip gradient norm of the latest step."),
    "sync_seconds": ("exgrpo_weight_sync_seconds", "Mean learner-side broadcast time of the latest syncs."),
    "actors": ("exgrpo_connected_actors", "Actors connected to the learner."),
    "tokens_per_s": ("exgrpo_learner_tokens_per_second", "Trained completion tokens per second of RL time."),
    "buffer_questions": ("exgrpo_buffer_questions", "Questions holding stored trajectories."),
    "buffer_trajectories": ("exgrpo_buffer_trajectories", "Stored trajectories."),
    "buffer_tokens": ("exgrpo_buffer_tokens", "Stored trajectory tokens."),
    "retired_total": ("exgrpo_retired_questions", "Questions retired (solved K/K), all time."),
    "experience_questions": ("exgrpo_batch_experience_questions", "Experience questions in the latest batch."),
    "selected_entropy_mean": ("exgrpo_selected_entropy_mean", "Mean entropy of the trajectories chosen for replay."),
    "replay_w_mean": ("exgrpo_replay_importance_weight_mean", "Mean w = pi_theta/pi_past on replayed tokens."),
    "replay_w_max": ("exgrpo_replay_importance_weight_max", "Largest w on replayed tokens."),
    "replay_token_frac": ("exgrpo_replay_token_fraction", "Share of trained tokens that were replayed."),
    "selection_seconds": ("exgrpo_selection_seconds", "Time to choose the next experience questions and trajectories."),
}
# cumulative metrics.jsonl fields -> counters
_COUNTERS = {
    "skipped_steps_total": ("exgrpo_learner_skipped_steps", "Optimizer updates skipped (non-finite or huge grad norm)."),
    "bad_messages_total": ("exgrpo_bad_messages", "Malformed messages dropped by the learner."),
    "stale_dropped_total": ("exgrpo_stale_groups_dropped", "Rollout groups dropped as too stale (re-issued)."),
    "verify_timeouts_total": ("exgrpo_verifier_timeouts", "Trained completions whose verification timed out."),
}


class LearnerMetrics:
    def __init__(self, host: str, port: int):
        self.registry = CollectorRegistry()
        self.gauges = {k: Gauge(n, h, registry=self.registry) for k, (n, h) in _GAUGES.items()}
        self.counters = {k: Counter(n, h, registry=self.registry) for k, (n, h) in _COUNTERS.items()}
        self._seen = {k: 0.0 for k in _COUNTERS}
        self.rollouts = Counter("exgrpo_learner_rollouts", "Completions trained on.", registry=self.registry)
        self.tokens = Counter("exgrpo_generated_tokens", "Generated completion tokens trained on.", registry=self.registry)
        self.buckets = Gauge("exgrpo_buffer_bucket_questions", "Eligible questions per success-count bucket.",
                             ["bucket"], registry=self.registry)
        self.batch_buckets = Gauge("exgrpo_batch_experience_questions_by_bucket",
                                   "Experience questions in the latest batch, by bucket at selection.", ["bucket"],
                                   registry=self.registry)
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_port

    def observe_step(self, row: dict) -> None:
        for key, gauge in self.gauges.items():
            if isinstance(row.get(key), (int, float)):
                gauge.set(float(row[key]))
        for key, counter in self.counters.items():
            if isinstance(row.get(key), (int, float)) and row[key] > self._seen[key]:
                counter.inc(row[key] - self._seen[key])
                self._seen[key] = row[key]
        self.rollouts.inc(row.get("rollouts", 0))
        self.tokens.inc(row.get("tokens_generated", 0))
        for k, n in (row.get("buckets") or {}).items():
            self.buckets.labels(bucket=str(k)).set(n)
        self.batch_buckets.clear()
        for k, n in (row.get("experience_by_bucket") or {}).items():
            self.batch_buckets.labels(bucket=str(k)).set(n)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
