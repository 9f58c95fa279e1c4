"""The monitoring files in ops/ are valid and agree with the series catalog in docs/metrics.md.

ops/prometheus/prometheus.yml and alerts.yml must pass promtool's checks, alerts_test.yml (promtool's
rule unit tests) must pass and cover every alert, the alerts must be exactly those of the alerts
table in docs/metrics.md, and the Grafana dashboard must load, query only catalogued series of the
selected run, and parse as PromQL. promtool checks skip when promtool is not on PATH, unless the CI
environment variable is set (CI installs it with ops/setup-prometheus.sh): then they fail.
A live Prometheus scraping a real run is tests/integration/test_prometheus.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.monitoring import dashboard, dashboard_exprs, expand, need_binary, panels

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "ops" / "prometheus"
METRICS_DOC = REPO / "docs" / "metrics.md"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_RE = re.compile(r"exgrpo_[a-z0-9_]+")


# ---------------------------------------------------------------- helpers

def _promtool() -> str:
    return need_binary("promtool")


def _run(cmd: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def _prometheus_section() -> str:
    text = METRICS_DOC.read_text()
    start = text.index("\n## Prometheus")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _catalog() -> tuple[set[str], set[str]]:
    """(every series name in the catalog tables, the histogram ones), from docs/metrics.md."""
    names, histograms = set(), set()
    for line in _prometheus_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or not cells[0].startswith("`exgrpo_"):
            continue
        row_names = set(METRIC_RE.findall(cells[0]))
        names |= row_names
        if cells[1] == "histogram":
            histograms |= row_names
    return names, histograms


def _alerts_table() -> set[str]:
    section = _prometheus_section()
    table = section[section.index("### Alerts"):]
    return set(re.findall(r"^\| `(Exgrpo[A-Za-z]+)` \|", table, flags=re.M))


def _alert_rules() -> list[dict]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _unknown_series(exprs: list[str]) -> dict[str, set[str]]:
    """expr -> the exgrpo_ series it uses that the catalog lacks (histogram suffixes only on histograms)."""
    names, histograms = _catalog()
    allowed = names | {h + s for h in histograms for s in HISTOGRAM_SUFFIXES}
    bad = {}
    for e in exprs:
        unknown = set(METRIC_RE.findall(e)) - allowed
        if unknown:
            bad[e] = unknown
    return bad


# ---------------------------------------------------------------- promtool

def test_prometheus_config_passes_promtool():
    promtool = _promtool()
    r = _run([promtool, "check", "config", str(PROM / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_alert_rules_pass_promtool():
    promtool = _promtool()
    r = _run([promtool, "check", "rules", str(PROM / "alerts.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in r.stdout + r.stderr


def test_alert_unit_tests_pass():
    promtool = _promtool()
    r = _run([promtool, "test", "rules", str(PROM / "alerts_test.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr and "FAILED" not in r.stdout + r.stderr


def test_dashboard_queries_parse_as_promql(tmp_path):
    """promtool 2.42 has no offline query parser, but `check rules` parses every rule's expr: each dashboard
    query (Grafana variables expanded) becomes a recording rule."""
    promtool = _promtool()
    exprs = [expand(e) for e in dashboard_exprs(dashboard())]
    assert exprs
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard_expr_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    r = _run([promtool, "check", "rules", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr
    # and the check really parses: a broken query fails it
    rules["groups"][0]["rules"].append({"record": "broken", "expr": "sum by (run) (rate(exgrpo_x[1m])"})
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    assert _run([promtool, "check", "rules", str(path)]).returncode != 0


# ---------------------------------------------------------------- alerts vs docs

def test_alerts_match_the_docs_table():
    documented = _alerts_table()
    assert len(documented) >= 7, documented
    defined = {r["alert"] for r in _alert_rules()}
    assert defined - documented == set(), "alerts.yml has alerts the docs/metrics.md table lacks"
    assert documented - defined == set(), "docs/metrics.md lists alerts that alerts.yml lacks"


def test_alert_rules_use_catalogued_series_and_say_what_to_check():
    rules = _alert_rules()
    assert _unknown_series([r["expr"] for r in rules]) == {}
    for r in rules:
        assert r.get("labels", {}).get("severity") in ("warning", "critical"), r["alert"]
        ann = r.get("annotations", {})
        assert ann.get("summary") and ann.get("description"), r["alert"]
        assert "docs/metrics.md" in ann["description"], r["alert"]


def test_alert_unit_tests_cover_every_alert_firing_and_quiet():
    doc = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    fires, quiet = set(), set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {r["alert"] for r in _alert_rules()}
    assert alerts - fires == set(), "alerts without a test that makes them fire"
    assert alerts - quiet == set(), "alerts without a test where they must stay quiet"


# ---------------------------------------------------------------- dashboard

def test_dashboard_is_importable_and_every_panel_queries():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    run_query = variables["run"]["query"]
    run_query = run_query["query"] if isinstance(run_query, dict) else run_query
    assert run_query == "label_values(exgrpo_learner_policy_version, run)"
    assert "actor_id" in variables

    every = panels(dash)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    queried = [p for p in every if p["type"] != "row"]
    assert len(queried) >= 20
    for p in queried:
        assert p.get("datasource", {}).get("uid") == "${DS_PROMETHEUS}", p["title"]
        assert p.get("gridPos"), p["title"]
        targets = [t for t in p.get("targets", []) if t.get("expr")]
        assert targets, f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]


def test_dashboard_queries_use_catalogued_series_of_the_selected_run():
    exprs = [t["expr"] for p in panels(dashboard()) for t in p.get("targets", []) if t.get("expr")]
    assert _unknown_series(exprs) == {}
    for e in exprs:
        selectors = re.findall(r"\b(exgrpo_[a-z0-9_]+|up)\b(\{[^}]*\})?", e)
        assert selectors, e
        for name, labels in selectors:
            assert 'run=~"$run"' in labels, f"{name} not filtered by run in: {e}"
