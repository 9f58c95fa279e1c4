"""What the learner's and the actors' Prometheus endpoints share: the HTTP server and bucket layouts.

Each process owns one CollectorRegistry served by prometheus-client's HTTP server on a host and port
from the config (127.0.0.1 by default; port 0 picks a free one). The series themselves live with the
process that owns the figures: learner/metrics.py and actors/metrics.py. The catalog is
docs/metrics.md; tests/unit/test_metrics.py checks that the two agree.
"""

from __future__ import annotations

import importlib.util
import os
import socket

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

disable_created_metrics()  # `*_created` timestamps double every counter's series and no panel uses them

# Durations from a few milliseconds (a toy weight sync, a fast-path verification) to minutes (a 7B
# step, a slow broadcast); the default client buckets stop at 10 s.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
# policy-version lag: integers, so each small lag gets its own bucket
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
# This host's name or address as Prometheus reaches it, for endpoints bound to a wildcard address. Per
# host, unlike the config (which actors receive from the learner): ops/slurm/node.sh sets it on each node.
ADVERTISE_ENV = "EXGRPO_ADVERTISE_HOST"
WILDCARDS = ("0.0.0.0", "::", "")


class MetricsEndpoint:
    """A registry and the HTTP server that serves it at /metrics."""

    def __init__(self, host: str, port: int):
        self.registry = CollectorRegistry()
        self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = host, self.server.server_port

    @property
    def address(self) -> str:
        """host:port for a scrape target; a wildcard bind is advertised under $EXGRPO_ADVERTISE_HOST, else
        this host's name (socket.getfqdn(), which other hosts may not resolve)."""
        host = self.host
        if host in WILDCARDS:
            host = os.environ.get(ADVERTISE_ENV, "").strip() or socket.getfqdn()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def check_trackers(names: list[str]) -> None:
    """ValueError naming the extra to install when a tracker of `metrics.trackers` lacks its library
    (checked by `train` before anything starts, and by the learner before it builds anything)."""
    for name in names:
        if importlib.util.find_spec(name) is None:  # the extras are named after their packages
            raise ValueError(f"metrics.trackers has {name!r} but the {name} package is not installed: "
                             f"pip install 'exgrpo-async[{name}]'")
