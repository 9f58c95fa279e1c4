"""The learner's Prometheus series and the service-discovery file that lets Prometheus find the actors.

`LearnerMetrics.observe_step(row)` turns each metrics.jsonl row into gauges, counters and histograms
(the row is the single source of truth for per-step figures); `observe_sync` and `observe_staleness`
take per-event values the row only summarises; `watch_live` binds gauges that must move even when no
step ends (connected actors, queue depths), because those are what the "no actors" and "stalled"
alerts watch. `TargetsFile` writes the Prometheus file-SD JSON: the learner plus every actor that
reported a metrics endpoint, rewritten atomically on every change. Catalog: docs/metrics.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from exgrpo_async.metrics import SECONDS_BUCKETS, STALENESS_BUCKETS, MetricsEndpoint

# metrics.jsonl field -> (gauge name, help)
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
    "tokens_per_s": ("exgrpo_learner_tokens_per_second", "Trained completion tokens per second of RL time."),
    "rollouts_per_s": ("exgrpo_learner_rollouts_per_second", "Trained completions per second of RL time."),
    "ratio_mean": ("exgrpo_learner_ratio_mean", "Mean PPO ratio over the latest step's fresh tokens."),
    "ratio_max": ("exgrpo_learner_ratio_max", "Largest PPO ratio of the latest step."),
    "clip_frac": ("exgrpo_learner_clip_fraction", "Share of trained tokens whose PPO term was clipped."),
    "is_weight_mean": ("exgrpo_learner_is_weight_mean", "Mean behaviour importance weight pi_prox/pi_behav."),
    "is_weight_max": ("exgrpo_learner_is_weight_max", "Largest behaviour importance weight, before truncation."),
    "is_truncated_frac": ("exgrpo_learner_is_truncated_fraction", "Share of fresh tokens whose weight was truncated."),
    "mismatch_kl": ("exgrpo_learner_mismatch_kl", "k3 KL(vLLM || learner) on rollouts of the learner's own version."),
    "behaviour_kl": ("exgrpo_learner_behaviour_kl", "k3 KL(behaviour || learner) on all fresh rollouts."),
    "truncated_frac": ("exgrpo_learner_truncated_fraction", "Completions of the latest batch cut at max_new_tokens."),
    "actor_idle_frac": ("exgrpo_learner_actor_idle_fraction", "The actors' idle share over the last step (1 - generating/elapsed)."),
    "buffer_questions": ("exgrpo_buffer_questions", "Questions holding stored trajectories."),
    "buffer_trajectories": ("exgrpo_buffer_trajectories", "Stored trajectories."),
    "buffer_tokens": ("exgrpo_buffer_tokens", "Stored trajectory tokens."),
    "buffer_bytes": ("exgrpo_buffer_bytes", "Bytes of stored token ids, log-probs and keys."),
    "retired_total": ("exgrpo_buffer_retired_questions", "Questions retired (solved K/K)."),
    "exgrpo_mixed": ("exgrpo_learner_experience_mixed", "1 once the delayed-start switch has fired."),
    "experience_questions": ("exgrpo_learner_experience_questions", "Experience groups in the latest batch."),
    "selected_entropy_mean": ("exgrpo_learner_selected_entropy_mean", "Mean entropy of trajectories chosen for replay."),
    "replay_w_mean": ("exgrpo_learner_replay_weight_mean", "Mean w = pi_theta/pi_past on replayed tokens."),
    "replay_w_max": ("exgrpo_learner_replay_weight_max", "Largest w on replayed tokens."),
    "replay_token_frac": ("exgrpo_learner_replay_token_fraction", "Share of trained tokens that were replayed."),
    "selection_seconds": ("exgrpo_learner_selection_seconds", "Time to choose the next experience questions."),
    "replay_reward_mean": ("exgrpo_learner_replay_reward_mean", "Re-verified reward of the latest batch's replayed trajectories."),
    "replay_age_mean": ("exgrpo_learner_replay_age_mean", "Mean policy versions between a replayed trajectory's generation and its replay."),
    "replay_count_max": ("exgrpo_learner_replay_count_max", "Most replays of one question so far."),
    "replay_top10_share": ("exgrpo_learner_replay_top10_share", "Share of all replays that went to the 10 most replayed questions."),
}
_EXGRPO_FIELDS = {"buffer_questions", "buffer_trajectories", "buffer_tokens", "buffer_bytes", "retired_total",
                  "exgrpo_mixed", "experience_questions", "selected_entropy_mean", "replay_w_mean", "replay_w_max",
                  "replay_token_frac", "selection_seconds", "replay_reward_mean", "replay_age_mean",
                  "replay_count_max", "replay_top10_share"}
_IS_FIELDS = {"is_weight_mean", "is_weight_max", "is_truncated_frac"}
# cumulative metrics.jsonl fields -> counters (incremented by the difference)
_COUNTERS = {
    "skipped_steps_total": ("exgrpo_learner_skipped_steps", "Optimizer updates skipped (non-finite or huge grad norm)."),
    "optimizer_updates_total": ("exgrpo_learner_optimizer_updates", "Optimizer updates applied."),
    "bad_messages_total": ("exgrpo_learner_bad_messages", "Malformed messages dropped by the learner."),
    "stale_dropped_total": ("exgrpo_learner_stale_groups_dropped", "Groups that arrived staler than eta (re-issued)."),
    "verify_timeouts_total": ("exgrpo_learner_verifier_timeouts", "Trained completions whose verification timed out."),
    "verify_errors_total": ("exgrpo_learner_verifier_errors", "Trained completions whose verifier crashed."),
}
# server counters (learner/server.py) -> counters, read at each step
_SERVER_COUNTERS = {
    "hellos": ("exgrpo_learner_actors_joined", "Actors that said hello (rejoins included)."),
    "joins_refused": ("exgrpo_learner_joins_refused",
                      "Hellos answered wait: transport.max_pending_joins actors were part-way through joining."),
    "actors_lost": ("exgrpo_learner_actors_lost", "Actors presumed dead."),
    "work_reissued": ("exgrpo_learner_work_reissued", "Work items re-issued past transport.work_deadline_s."),
    "work_released": ("exgrpo_learner_work_released", "Work items taken back from actors that left or died."),
    "sync_failures": ("exgrpo_weight_sync_failures", "Weight-sync jobs that failed."),
    "weight_fingerprint_mismatches": ("exgrpo_weight_fingerprint_mismatches",
                                      "Loads after which an actor's engine did not hold the weights it was sent."),
    "fingerprint_rejected_groups": ("exgrpo_learner_fingerprint_rejected_groups",
                                    "Groups generated with weights whose fingerprint was wrong (re-issued)."),
}


class LearnerMetrics:
    def __init__(self, host: str, port: int, max_staleness: int, exgrpo: bool = True, is_weights: bool = True):
        """`exgrpo`, `is_weights`: export the buffer/replay series and the behaviour-weight series only
        when the run computes them (a gauge that is never set would read 0, not "absent")."""
        self.endpoint = MetricsEndpoint(host, port)
        r = self.endpoint.registry
        self.port = self.endpoint.port
        skip = (set() if exgrpo else _EXGRPO_FIELDS) | (set() if is_weights else _IS_FIELDS)
        self.gauges = {k: Gauge(n, h, registry=r) for k, (n, h) in _GAUGES.items() if k not in skip}
        self.counters = {k: Counter(n, h, registry=r) for k, (n, h) in {**_COUNTERS, **_SERVER_COUNTERS}.items()}
        self._seen = {k: 0.0 for k in self.counters}
        self.steps = Counter("exgrpo_learner_steps", "Learner steps done by this process.", registry=r)
        self.rollouts = Counter("exgrpo_learner_rollouts", "Completions trained on.", registry=r)
        self.tokens = Counter("exgrpo_learner_trained_tokens", "Completion tokens trained on.", registry=r)
        self.last_step = Gauge("exgrpo_learner_last_step_timestamp_seconds",
                               "Unix time the latest step ended (the RL loop's start before the first).", registry=r)
        self.step_duration = Histogram("exgrpo_learner_step_duration_seconds", "Wall time per learner step.",
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.staleness = Histogram("exgrpo_learner_staleness", "Policy-version lag of each trained group.",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.sync_duration = Histogram("exgrpo_weight_sync_duration_seconds",
                                       "Learner-side broadcast time of each weight sync.", buckets=SECONDS_BUCKETS,
                                       registry=r)
        Gauge("exgrpo_learner_max_staleness", "eta: learner.max_staleness.", registry=r).set(max_staleness)
        self.buckets = self.batch_buckets = None
        self._shown: dict[str, set[str]] = {"buffer": set(), "batch": set()}  # bucket labels each gauge has shown
        if exgrpo:
            self.buckets = Gauge("exgrpo_buffer_bucket_questions", "Eligible questions per success-count bucket.",
                                 ["bucket"], registry=r)
            self.batch_buckets = Gauge("exgrpo_learner_experience_bucket_questions",
                                       "Experience questions in the latest batch, by bucket at selection.", ["bucket"],
                                       registry=r)
        self.live = {n: Gauge(n, h, registry=r) for n, h in (
            ("exgrpo_learner_connected_actors", "Actors connected now."),
            ("exgrpo_learner_inbox_groups", "Rollout groups received and not yet trained."),
            ("exgrpo_learner_work_in_flight", "Work items handed to actors and not yet returned."),
        )}

    def watch_live(self, connected: Callable[[], float], inbox: Callable[[], float],
                   in_flight: Callable[[], float]) -> None:
        """Bind the live gauges to callables, evaluated at each scrape (they must be thread-safe reads)."""
        for name, fn in (("exgrpo_learner_connected_actors", connected), ("exgrpo_learner_inbox_groups", inbox),
                         ("exgrpo_learner_work_in_flight", in_flight)):
            self.live[name].set_function(fn)

    def mark_progress(self) -> None:
        """The RL loop started (or resumed): the stall alert measures from here until the first step."""
        self.last_step.set(time.time())

    def observe_sync(self, seconds: float) -> None:
        self.sync_duration.observe(seconds)

    def observe_step(self, row: dict, server_counters: dict | None = None) -> None:
        for key, gauge in self.gauges.items():
            v = row.get(key)
            if isinstance(v, (int, float)):  # bools too (exgrpo_mixed); None leaves the last value
                gauge.set(float(v))
        cumulative = {**row, **(server_counters or {})}
        for key, counter in self.counters.items():
            v = cumulative.get(key)
            if isinstance(v, (int, float)) and v > self._seen[key]:
                counter.inc(v - self._seen[key])
                self._seen[key] = v
        self.steps.inc()
        self.rollouts.inc(row.get("rollouts", 0))
        self.tokens.inc(row.get("tokens_generated", 0))
        self.last_step.set(time.time())
        if isinstance(row.get("step_seconds"), (int, float)):
            self.step_duration.observe(row["step_seconds"])
        for lag, n in (row.get("staleness_hist") or {}).items():
            for _ in range(int(n)):
                self.staleness.observe(int(lag))
        if self.buckets is None:
            return
        _set_by_bucket(self.buckets, self._shown["buffer"], row.get("buckets") or {})
        if "experience_by_bucket" in row:
            _set_by_bucket(self.batch_buckets, self._shown["batch"], row["experience_by_bucket"] or {})

    def close(self) -> None:
        self.endpoint.close()


def _set_by_bucket(gauge: Gauge, shown: set[str], counts: dict) -> None:
    """Set a per-bucket gauge to `counts`, and to 0 every bucket in `shown` (those it showed before, kept
    up to date here) that `counts` lacks: an emptied bucket reads 0, not its last count, and a series that
    came and went with each batch no longer flickers on the dashboard or falls between two scrapes."""
    counts = {str(k): n for k, n in counts.items()}
    shown |= set(counts)
    for bucket in shown:
        gauge.labels(bucket=bucket).set(counts.get(bucket, 0))


class TargetsFile:
    """Prometheus file-based service discovery for one run: `[{"targets": [...], "labels": {...}}]`.

    Written to RUN_DIR/prometheus-targets.json and, when `sd_dir` is set, to sd_dir/<run>.json (removed
    at close, so a finished run's targets leave Prometheus). Writes go to a temporary file renamed over
    the old one: Prometheus never reads a half-written file."""

    def __init__(self, run_dir: Path, sd_dir: str | None, learner_address: str | None):
        self.run = run_dir.name
        self.paths = [run_dir / "prometheus-targets.json"]
        if sd_dir:
            Path(sd_dir).mkdir(parents=True, exist_ok=True)
            self.paths.append(Path(sd_dir) / f"{self.run}.json")
        self.learner = learner_address
        self.actors: dict[str, str] = {}
        self.write()

    def update(self, actors: dict[str, str]) -> None:
        """actors: actor id -> metrics host:port. Rewrites the files only when something changed."""
        if actors != self.actors:
            self.actors = dict(actors)
            self.write()

    def groups(self) -> list[dict]:
        out = []
        if self.learner:
            out.append({"targets": [self.learner], "labels": {"role": "learner", "run": self.run}})
        for actor_id, address in sorted(self.actors.items()):
            out.append({"targets": [address], "labels": {"role": "actor", "actor_id": actor_id, "run": self.run}})
        return out

    def write(self) -> None:
        text = json.dumps(self.groups(), indent=1)
        for path in self.paths:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def close(self) -> None:
        """The run is over: no targets (a Prometheus pointed at run folders must not see a finished run's
        endpoints as down), and the sd_dir copy goes."""
        self.learner, self.actors = None, {}
        self.write()
        for path in self.paths[1:]:
            path.unlink(missing_ok=True)
