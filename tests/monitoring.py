"""Helpers shared by the monitoring tests: the Prometheus binaries and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "ops" / "grafana" / "exgrpo-dashboard.json"
# Grafana's variables and built-ins, as Grafana would expand them for a query
GRAFANA_SUBST = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "10m", "${run}": ".*", "$run": ".*",
                 "${actor_id}": ".*", "$actor_id": ".*"}


def need_binary(name: str) -> str:
    """A Prometheus binary's path; skips without it, fails without it under CI (ops/setup-prometheus.sh
    installs it there). Call it in the test body, so a missing binary is that test's FAILED."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not on PATH in CI: ops/setup-prometheus.sh should have installed it")
        pytest.skip(f"{name} not on PATH (ops/setup-prometheus.sh installs Debian's prometheus package)")
    return path


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    """All panels, rows' nested (collapsed) panels included."""
    return [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]


def dashboard_exprs(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and annotation queries."""
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", []) if t.get("expr")]
    exprs += [a["expr"] for a in dash.get("annotations", {}).get("list", []) if a.get("expr")]
    return exprs


def expand(expr: str) -> str:
    for k, v in GRAFANA_SUBST.items():
        expr = expr.replace(k, v)
    return expr
