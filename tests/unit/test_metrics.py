"""The learner's Prometheus endpoint serves the metrics.jsonl figures under exgrpo_ names."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from exgrpo_async.metrics import LearnerMetrics


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_step_rows_become_prometheus_series():
    m = LearnerMetrics("127.0.0.1", 0)
    try:
        m.observe_step({"policy_version": 3, "reward_mean": 0.25, "rollouts": 256, "tokens_generated": 9000,
                        "skipped_steps_total": 1, "buckets": {"1": 4, "4": 9}, "experience_by_bucket": {"4": 2},
                        "replay_w_max": 1.7, "selected_entropy_mean": None})
        m.observe_step({"policy_version": 4, "rollouts": 256, "tokens_generated": 1000, "skipped_steps_total": 1,
                        "buckets": {"1": 5}})
        got = scrape(m.port)
    finally:
        m.close()
    assert got[("exgrpo_learner_policy_version", ())] == 4
    assert got[("exgrpo_learner_rollouts_total", ())] == 512
    assert got[("exgrpo_generated_tokens_total", ())] == 10000
    assert got[("exgrpo_learner_skipped_steps_total", ())] == 1  # cumulative field, counted once
    assert got[("exgrpo_buffer_bucket_questions", (("bucket", "1"),))] == 5
    assert got[("exgrpo_buffer_bucket_questions", (("bucket", "4"),))] == 9
    assert ("exgrpo_batch_experience_questions_by_bucket", (("bucket", "4"),)) not in got  # latest batch only
    assert got[("exgrpo_replay_importance_weight_max", ())] == 1.7
