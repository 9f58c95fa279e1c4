"""ops/bench/system/soak.py's memory figures: a leak raises every window's peak; an RSS that swings between a
floor and a fixed ceiling does not, however its samples fall. Synthetic samples."""

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def soak():
    return load_bench("system/soak")


def _samples(mb_at) -> list[dict]:
    return [{"t": float(t), "steps": t // 2, "learner_mb": mb_at(t), "actors_mb": []} for t in range(0, 3600, 5)]


def test_a_leak_raises_the_peak_slope(soak):
    leak = _samples(lambda t: 800 + 2.0 * t / 60 + (40 if (t // 5) % 3 == 0 else 0))  # 2 MB/min under the swing
    out = soak.window_slopes(leak, 300, 300)
    assert out["slopes"]["peak"] == pytest.approx(2.0, abs=0.05)
    assert out["slopes"]["floor"] == pytest.approx(2.0, abs=0.05)
    assert len(out["windows_mb"]["peak"]) == 10  # 5 to 55 min; the last window, not over when sampling ends, is left out


def test_a_floor_settling_under_a_fixed_ceiling_is_not_a_leak(soak):
    # the ceiling is 900 MB throughout; the floor climbs from 700 to 840 MB by 30 min and stays there, and
    # the samples sit at the ceiling more often later: the least-squares slope over samples is well
    # above 1 MB/min, the peak's is 0
    def mb(t: int) -> float:
        high = (t // 5) % (4 if t < 1800 else 2) == 0
        return 900.0 if high else min(840.0, 700.0 + 140.0 * t / 1800)
    samples = _samples(mb)
    assert soak.slope_mb_per_min(samples, 300) > 1.0
    out = soak.window_slopes(samples, 300, 300)
    assert out["slopes"]["peak"] == pytest.approx(0.0, abs=1e-9)
    assert out["slopes"]["floor"] > 1.0


def test_too_few_windows_give_no_slope(soak):
    out = soak.window_slopes(_samples(lambda t: 800.0)[:100], 300, 300)  # 500 s: one whole window after warm-up
    assert out["slopes"] == {"peak": None, "median": None, "floor": None}
    assert soak.window_slopes([], 300, 300)["slopes"]["peak"] is None


def test_a_kill_waits_for_an_actor_that_serves(soak, tmp_path):
    """The soak kills or freezes only an actor serving the learner (its log: "actor-N joined from ... (pid P)",
    then "actor-N: weight-sync group of ..."): one still starting its engine holds no work and is not presumed
    dead for transport.join_timeout_s, so the books the soak checks would not follow."""
    import signal
    import subprocess

    import psutil

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        actors = [psutil.Process(p.pid) for p in procs]
        log = tmp_path / "train.log"
        log.write_text(f"12:00:00 INFO [learner] x: actor-1 joined from 'vm' (pid {procs[1].pid})\n"
                       f"12:00:00 INFO [learner] x: actor-2 joined from 'vm' (pid {procs[0].pid})\n")
        assert soak.serving_pids(log) == set()  # joined, engines starting
        schedule = soak.Schedule("tcp://127.0.0.1:1", 15.0, tmp_path)
        schedule.next(10.0, actors, soak.serving_pids(log))  # none serves yet: the kill waits
        assert schedule.done == [] and all(p.poll() is None for p in procs)
        with log.open("a") as f:
            f.write("12:00:05 INFO [learner] x: actor-1: weight-sync group of 2 (tensor parallel 1)\n")
        assert soak.serving_pids(log) == {procs[1].pid}
        schedule.next(12.0, actors, soak.serving_pids(log))
        assert schedule.done == [{"t": 12.0, "event": "kill"}]
        assert procs[1].wait(timeout=10) == -signal.SIGKILL and procs[0].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_remove_waits_for_the_added_actor_to_serve(soak, tmp_path, monkeypatch):
    """The cycle's "remove" stops the actor its "add" started only once that one serves the learner: at the
    AVX2-only pace one was removed 2 s after its start, never having joined (the CI soak's books then missed it)."""
    import subprocess
    import sys

    started, real_popen = [], subprocess.Popen

    def popen(*args, **kwargs):  # the added actor: a process that sleeps, in place of `exgrpo-async actor`
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    monkeypatch.setattr(soak.subprocess, "Popen", popen)
    schedule = soak.Schedule("tcp://127.0.0.1:1", 15.0, tmp_path)
    schedule.n = soak.CYCLE.index("add")
    try:
        schedule.next(1.0, [], set())
        assert [e["event"] for e in schedule.done] == ["add"] and len(started) == 1
        schedule.next(2.0, [], set())  # not serving yet: the remove waits
        assert [e["event"] for e in schedule.done] == ["add"] and started[0].poll() is None
        schedule.next(3.0, [], {started[0].pid})
        assert [e["event"] for e in schedule.done] == ["add", "remove"] and started[0].poll() is not None
    finally:
        for p in started:
            p.kill()
            p.wait()


def test_the_run_goes_on_until_the_planned_events_are_done():
    """Events that fell behind the clock (a kill or freeze waits for an actor serving the learner) keep the run
    going past --minutes until done and every/2 seconds old, at most LATE_S: at the AVX2-only pace the CI soak
    (0.6 min, every 7 s) ended after kill, freeze and add, its "remove" never done (2026-11-28)."""
    soak = load_bench("system/soak")
    assert soak.planned_events(0.6, 7) == 4 and soak.planned_events(60, 60) == 59  # as the old schedule held
    late = [{"t": 8.1}, {"t": 30.3}, {"t": 32.3}]
    assert not soak.stop_due(30.0, 0.6, 7, late, 4)  # before --minutes
    assert not soak.stop_due(36.0, 0.6, 7, late, 4)  # "remove" still to come
    assert not soak.stop_due(40.0, 0.6, 7, [*late, {"t": 39.0}], 4)  # done, but under every/2 ago
    assert soak.stop_due(42.6, 0.6, 7, [*late, {"t": 39.0}], 4)
    assert soak.stop_due(36.0 + soak.LATE_S, 0.6, 7, late, 4)  # never waits past LATE_S
    assert soak.stop_due(36.0, 0.6, 7, [{"t": 7.0}, {"t": 14.0}, {"t": 21.0}, {"t": 28.0}], 4)  # on time
