"""An actor's Prometheus series: generation throughput, verification, weight updates, work in hand.

The endpoint starts once the learner's welcome has brought the config (`metrics.actor_host`,
`metrics.actor_port`; port 0 picks a free one) and lives as long as the process, across rejoins, so
counters never reset while the process runs. The actor reports the endpoint's address in its work
requests; the learner puts it in the Prometheus service-discovery file with the actor's id as a
label. Catalog: docs/metrics.md.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram

from exgrpo_async.config import RunConfig
from exgrpo_async.metrics import SECONDS_BUCKETS, MetricsEndpoint
from exgrpo_async.rollout import RolloutGroup

log = logging.getLogger("exgrpo_async.actors.metrics")


class ActorMetrics:
    def __init__(self, host: str, port: int):
        self.endpoint = MetricsEndpoint(host, port)
        self.address = self.endpoint.address
        r = self.endpoint.registry
        self.version = Gauge("exgrpo_actor_policy_version", "Version of the weights the engine holds.", registry=r)
        self.version.set(-1)
        self.groups = Counter("exgrpo_actor_groups", "Rollout groups sent to the learner.", registry=r)
        self.completions = Counter("exgrpo_actor_completions", "Completions in the groups sent.", registry=r)
        self.tokens = Counter("exgrpo_actor_generated_tokens", "Completion tokens generated and sent.", registry=r)
        self.gen_seconds = Counter("exgrpo_actor_generation_seconds", "Engine time spent generating.", registry=r)
        self.verifications = Counter("exgrpo_actor_verifications", "Completions verified, by status.", ["status"],
                                     registry=r)
        for status in ("ok", "timeout", "error"):  # present at 0, so rate ratios exist before the first timeout
            self.verifications.labels(status=status)
        self.verify_duration = Histogram("exgrpo_actor_verify_duration_seconds", "Verification time per completion.",
                                         buckets=SECONDS_BUCKETS, registry=r)
        self.syncs = Counter("exgrpo_actor_weight_syncs", "Weight updates received.", registry=r)
        self.load_duration = Histogram("exgrpo_actor_weight_load_duration_seconds",
                                       "Actor-side receive + load time per weight update.", buckets=SECONDS_BUCKETS,
                                       registry=r)
        self.stall = Histogram("exgrpo_actor_update_stall_seconds",
                               "Stream engine: time generation was stopped per in-flight update.",
                               buckets=SECONDS_BUCKETS, registry=r)
        self.inflight = Gauge("exgrpo_actor_inflight_groups", "Work items being generated or verified now.",
                              registry=r)
        self.rejoins = Counter("exgrpo_actor_rejoins", "Times the actor lost the learner and joined again.",
                               registry=r)

    def observe_verify(self, statuses: list[str], latencies: list[float]) -> None:
        for s in statuses:
            self.verifications.labels(status=s).inc()
        for t in latencies:
            self.verify_duration.observe(t)

    def observe_sent(self, group: RolloutGroup) -> None:
        self.groups.inc()
        self.completions.inc(len(group.completions))
        self.tokens.inc(group.num_tokens)

    def observe_sync(self, version: int, seconds: float) -> None:
        self.syncs.inc()
        self.load_duration.observe(seconds)
        self.version.set(version)

    def close(self) -> None:
        self.endpoint.close()


def start_actor_metrics(cfg: RunConfig, actor_id: str) -> ActorMetrics | None:
    """The endpoint, or None when `metrics.actor_port` is None (off)."""
    m = cfg.metrics
    if m.actor_port is None:
        return None
    try:
        metrics = ActorMetrics(m.actor_host, m.actor_port)
    except OSError as e:  # e.g. a fixed port taken by another actor on this host
        raise RuntimeError(f"{actor_id}: cannot serve metrics on {m.actor_host}:{m.actor_port}: {e} "
                           "(metrics.actor_port=0 picks a free port; None turns actor metrics off)") from e
    log.info("%s: Prometheus metrics on http://%s/metrics", actor_id, metrics.address)
    return metrics


def warn_verifier_timeouts(actor_id: str, statuses: list[str], threshold: float) -> None:
    """The log line behind the ExgrpoVerifierTimeouts alert, per verified batch."""
    timeouts = statuses.count("timeout")
    if statuses and timeouts / len(statuses) > threshold:
        log.warning("%s: %d of %d verifications timed out (actor.verifier.timeout_s; ExgrpoVerifierTimeouts)",
                    actor_id, timeouts, len(statuses))
