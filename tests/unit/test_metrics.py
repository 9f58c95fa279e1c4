"""Prometheus endpoints: step rows become series, actors count what they do, the SD file follows
membership, the catalog in docs/metrics.md lists exactly what the code exports, and logs have one
format (text or JSON lines) tagged with role and id."""

import json
import logging
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import ActorMetrics
from exgrpo_async.logs import log_format, setup_logging
from exgrpo_async.rollout import Completion, RolloutGroup
from learner.metrics import LearnerMetrics, TargetsFile

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_series_the_run_does_not_compute_are_absent_not_zero():
    m = LearnerMetrics("127.0.0.1", 0, max_staleness=1, exgrpo=False, is_weights=False)
    try:
        m.observe_step({"policy_version": 1, "buckets": {"1": 3}, "is_weight_max": 2.0, "rollouts": 8})
        names = {name for name, _ in scrape(m.port)}
    finally:
        m.close()
    assert "exgrpo_learner_policy_version" in names and "exgrpo_learner_rollouts_total" in names
    assert not {n for n in names if n.startswith("exgrpo_buffer_") or "is_weight" in n or "replay" in n}


def test_step_rows_become_prometheus_series():
    m = LearnerMetrics("127.0.0.1", 0, max_staleness=2)
    try:
        m.observe_step({"policy_version": 3, "reward_mean": 0.25, "rollouts": 256, "tokens_generated": 9000,
                        "skipped_steps_total": 1, "optimizer_updates_total": 3, "buckets": {"1": 4, "4": 9},
                        "experience_by_bucket": {"4": 2}, "replay_w_max": 1.7, "selected_entropy_mean": None,
                        "staleness_hist": {"0": 3, "2": 1}, "step_seconds": 0.3, "exgrpo_mixed": True},
                       {"hellos": 2, "actors_lost": 0})
        m.observe_step({"policy_version": 4, "rollouts": 256, "tokens_generated": 1000, "skipped_steps_total": 1,
                        "optimizer_updates_total": 7, "buckets": {"1": 5}, "experience_by_bucket": {},
                        "staleness_hist": {"1": 2}, "step_seconds": 40.0}, {"hellos": 3, "actors_lost": 1})
        m.observe_sync(0.02)
        m.watch_live(connected=lambda: 5, inbox=lambda: 7, in_flight=lambda: 11)
        got = scrape(m.port)
    finally:
        m.close()
    assert got[("exgrpo_learner_policy_version", ())] == 4
    assert got[("exgrpo_learner_rollouts_total", ())] == 512
    assert got[("exgrpo_learner_trained_tokens_total", ())] == 10000
    assert got[("exgrpo_learner_steps_total", ())] == 2
    assert got[("exgrpo_learner_skipped_steps_total", ())] == 1  # cumulative field, counted once
    assert got[("exgrpo_learner_optimizer_updates_total", ())] == 7
    assert got[("exgrpo_learner_actors_joined_total", ())] == 3 and got[("exgrpo_learner_actors_lost_total", ())] == 1
    assert got[("exgrpo_learner_max_staleness", ())] == 2
    assert got[("exgrpo_learner_experience_mixed", ())] == 1
    assert got[("exgrpo_buffer_bucket_questions", (("bucket", "1"),))] == 5
    assert got[("exgrpo_buffer_bucket_questions", (("bucket", "4"),))] == 0  # emptied: 0, not its last count
    assert got[("exgrpo_learner_experience_bucket_questions", (("bucket", "4"),))] == 0  # latest batch only
    assert got[("exgrpo_learner_replay_weight_max", ())] == 1.7
    # histograms: 6 groups with lags 0,0,0,2,1,1; steps of 0.3 s and 40 s; one sync of 20 ms
    assert got[("exgrpo_learner_staleness_count", ())] == 6 and got[("exgrpo_learner_staleness_sum", ())] == 4
    assert got[("exgrpo_learner_staleness_bucket", (("le", "0.0"),))] == 3
    assert got[("exgrpo_learner_staleness_bucket", (("le", "1.0"),))] == 5
    assert got[("exgrpo_learner_step_duration_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("exgrpo_learner_step_duration_seconds_count", ())] == 2
    assert got[("exgrpo_weight_sync_duration_seconds_count", ())] == 1
    assert got[("exgrpo_learner_connected_actors", ())] == 5
    assert got[("exgrpo_learner_inbox_groups", ())] == 7 and got[("exgrpo_learner_work_in_flight", ())] == 11
    assert got[("exgrpo_learner_last_step_timestamp_seconds", ())] > 1.7e9


def _group(n: int, tokens_each: int) -> RolloutGroup:
    import numpy as np

    comps = [Completion(np.arange(tokens_each, dtype=np.int32), np.zeros(tokens_each, np.float32), 1.0, "stop", "ok")
             for _ in range(n)]
    return RolloutGroup(1, 0, np.arange(3, dtype=np.int32), comps, 0, "actor-1", "train", 0.1, {})


def test_actor_series_count_generation_verification_and_syncs():
    m = ActorMetrics("127.0.0.1", 0)
    try:
        assert m.address == f"127.0.0.1:{m.endpoint.port}"
        before = scrape(m.endpoint.port)
        m.observe_verify(["ok", "ok", "timeout", "error"], [0.001, 0.002, 5.0, 0.3])
        m.observe_sent(_group(4, 10))
        m.observe_sent(_group(2, 5))
        m.observe_sync(7, 0.05)
        got = scrape(m.endpoint.port)
    finally:
        m.close()
    assert before[("exgrpo_actor_verifications_total", (("status", "timeout"),))] == 0  # exists before any timeout
    assert before[("exgrpo_actor_policy_version", ())] == -1
    assert got[("exgrpo_actor_verifications_total", (("status", "ok"),))] == 2
    assert got[("exgrpo_actor_verifications_total", (("status", "timeout"),))] == 1
    assert got[("exgrpo_actor_verify_duration_seconds_count", ())] == 4
    assert got[("exgrpo_actor_verify_duration_seconds_bucket", (("le", "0.001"),))] == 1
    assert got[("exgrpo_actor_groups_total", ())] == 2 and got[("exgrpo_actor_completions_total", ())] == 6
    assert got[("exgrpo_actor_generated_tokens_total", ())] == 50
    assert got[("exgrpo_actor_policy_version", ())] == 7 and got[("exgrpo_actor_weight_syncs_total", ())] == 1


def test_targets_file_follows_membership(tmp_path):
    run = tmp_path / "run-1"
    run.mkdir()
    sd = tmp_path / "targets"
    t = TargetsFile(run, str(sd), "127.0.0.1:9000")
    read = lambda p: json.loads(p.read_text())  # noqa: E731
    assert read(sd / "run-1.json") == [{"targets": ["127.0.0.1:9000"], "labels": {"role": "learner", "run": "run-1"}}]
    t.update({"actor-2": "127.0.0.1:9102", "actor-1": "127.0.0.1:9101"})
    groups = read(run / "prometheus-targets.json")
    assert [g["labels"].get("actor_id") for g in groups] == [None, "actor-1", "actor-2"]
    assert groups[1] == {"targets": ["127.0.0.1:9101"], "labels": {"role": "actor", "actor_id": "actor-1", "run": "run-1"}}
    t.update({"actor-2": "127.0.0.1:9102"})  # actor-1 left or died
    assert [g["targets"][0] for g in read(sd / "run-1.json")] == ["127.0.0.1:9000", "127.0.0.1:9102"]
    t.close()
    assert not (sd / "run-1.json").exists()  # a finished run leaves Prometheus
    assert read(run / "prometheus-targets.json") == []  # a finished run has no targets left
    assert not list(run.glob(".*.tmp")) and not list(sd.glob(".*"))


def test_wildcard_endpoint_is_advertised_under_this_hosts_address(monkeypatch):
    """metrics.actor_host=0.0.0.0 (one value for every actor, from the learner's config): each host says
    under which name Prometheus reaches it (EXGRPO_ADVERTISE_HOST, set per node by ops/slurm/node.sh)."""
    import socket

    from exgrpo_async.metrics import MetricsEndpoint

    def endpoint(host: str) -> MetricsEndpoint:  # the address only: no server
        e = MetricsEndpoint.__new__(MetricsEndpoint)
        e.host, e.port = host, 9100
        return e

    monkeypatch.delenv("EXGRPO_ADVERTISE_HOST", raising=False)
    assert endpoint("0.0.0.0").address == f"{socket.getfqdn()}:9100"
    monkeypatch.setenv("EXGRPO_ADVERTISE_HOST", "gpu-7.cluster")
    assert endpoint("0.0.0.0").address == "gpu-7.cluster:9100"
    assert endpoint("::").address == "gpu-7.cluster:9100"
    monkeypatch.setenv("EXGRPO_ADVERTISE_HOST", "fd00::7")
    assert endpoint("0.0.0.0").address == "[fd00::7]:9100"
    assert endpoint("10.0.0.5").address == "10.0.0.5:9100"  # a bound address is what it is


def _exported_names() -> set[str]:
    """Every series the two endpoints export, as the catalog names them (counters with _total)."""
    names = set()
    learner, actor = LearnerMetrics("127.0.0.1", 0, 1), ActorMetrics("127.0.0.1", 0)
    try:
        for reg in (learner.endpoint.registry, actor.endpoint.registry):
            for fam in reg.collect():
                names.add(fam.name + ("_total" if fam.type == "counter" else ""))
                assert fam.name.startswith("exgrpo_"), fam.name
                if fam.type == "histogram":
                    assert fam.name.endswith("_seconds") or fam.name == "exgrpo_learner_staleness", fam.name
    finally:
        learner.close()
        actor.close()
    return names


def test_catalog_lists_exactly_the_exported_series():
    text = DOCS.read_text()
    section = text[text.index("## Prometheus"):text.index("### Alerts")]
    documented = set(re.findall(r"`(exgrpo_[a-z0-9_]+)(?:\{[a-z_]+\})?`", section))
    exported = _exported_names()
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "documented but not exported"


@pytest.fixture
def restore_logging(monkeypatch):
    monkeypatch.setenv("EXGRPO_LOG_FORMAT", "text")  # undone after the test, as are the root handlers
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_log_lines_carry_role_and_id(capsys, monkeypatch, restore_logging):
    monkeypatch.delenv("EXGRPO_LOG_FORMAT")
    setup_logging("actor", "actor-3", fmt="json")
    logging.getLogger("exgrpo_async.test").warning("verifier %d of %d", 2, 9)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("exgrpo_async.test").exception("failed")
    lines = capsys.readouterr().err.strip().splitlines()
    first, second = json.loads(lines[-2]), json.loads(lines[-1])
    assert (first["role"], first["id"], first["level"], first["msg"]) == ("actor", "actor-3", "WARNING", "verifier 2 of 9")
    assert "RuntimeError: boom" in second["exc"]
    assert log_format() == "json"  # exported for child processes
    setup_logging("learner", fmt="text")
    logging.getLogger("exgrpo_async.test").warning("plain")
    assert re.search(r"^\d\d:\d\d:\d\d WARNING \[learner\] exgrpo_async.test: plain$", capsys.readouterr().err, re.M)
    monkeypatch.setenv("EXGRPO_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="log format 'xml'"):
        log_format()


def test_a_taken_actor_port_is_a_clear_error():
    from actors.metrics import start_actor_metrics
    from exgrpo_async.config_io import load_config

    first = ActorMetrics("127.0.0.1", 0)
    try:
        cfg = load_config(None, [f"metrics.actor_port={first.endpoint.port}"])
        with pytest.raises(RuntimeError, match="metrics.actor_port=0 picks a free port"):
            start_actor_metrics(cfg, "actor-2")
        assert start_actor_metrics(load_config(None, ["metrics.actor_port=none"]), "actor-3") is None
    finally:
        first.close()
