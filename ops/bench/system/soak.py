"""Soak: one training run for `--minutes`, with actors killed, frozen, added and removed on a schedule.

A real `exgrpo-async train` (the toy task, held-out evaluation off, restarts enough for the schedule)
trains for `--minutes` from its first step, when this script ends it with RUN_DIR/STOP (however long
the start took, the schedule is the same; `learner.max_seconds` is only a safety cap, 5 minutes
later). Meanwhile, every `--every` seconds, it does the next event of the cycle
- kill: SIGKILL one of the launcher's actors (the launcher restarts it; the learner re-issues its work),
- freeze: SIGSTOP one for `--freeze` seconds, then SIGCONT (its heartbeat stops; it is presumed dead
  after `transport.actor_timeout_s` and rejoins when it wakes),
- add: start one more actor (`exgrpo-async actor --learner ADDR`) that joins the running learner,
- remove: SIGTERM the added actor (it says bye; its work is released),
and every `--sample` seconds records the resident memory (RSS) of the learner and of each actor (an
actor with its in-process vLLM engine) and the steps done. At the end it reports steps/min, the
learner's RSS slope after warm-up (least squares over the samples after the first `--warmup`
minutes; target under 1 MB/min) and the slopes of its per-`--window` peak, median and floor (a leak
raises every window's peak; an allocator that keeps freed pages raises the floor up to the peak and
no further), the actors' RSS range, the events done, and from summary.json the
question books (`questions_unaccounted`, target 0), stale drops, actors lost and joined, restarts.

    .venv/bin/python ops/bench/system/soak.py --minutes 60 [--every 60] [--out bench_out/soak] [overrides...]
    .venv/bin/python ops/bench/system/soak.py --minutes 0.6 --every 7 --sample 2 --warmup 0.3   # the CI version (tests/)
    .venv/bin/python ops/bench/system/soak.py --from bench_out/soak60/soak.json     # the figures again, from its samples
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402

CYCLE = ("kill", "freeze", "add", "remove")
LATE_S = 120  # how long the run may go on past --minutes for events that fell behind (`stop_due`)
SAFETY_S = 300  # learner.max_seconds beyond --minutes: ends the run should this script fail to


def roles(launcher: psutil.Process) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """(the learner, the launcher's actors) among the launcher's children."""
    learner, actors = None, []
    for child in launcher.children():
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "learner" in cmd:
            learner = child
        elif "actor" in cmd:
            actors.append(child)
    return learner, actors


def serving_pids(log: Path) -> set[int]:
    """The pids of actors serving the learner: it said they joined ("actor-N joined from 'host' (pid P)") and
    formed their weight-sync group ("actor-N: weight-sync group of ..."), their engine up; from the run's log."""
    text = log.read_text(errors="replace")
    joined = dict(re.findall(r"(actor-\d+) joined from .*\(pid '?(\d+)'?\)", text))
    grouped = set(re.findall(r"(actor-\d+): weight-sync group of", text))
    return {int(pid) for actor, pid in joined.items() if actor in grouped}


def rss_mb(p: psutil.Process) -> float | None:
    """Resident MB, None for a process gone or a zombie (killed, not yet reaped: RSS 0)."""
    try:
        rss = p.memory_info().rss
    except psutil.NoSuchProcess:
        return None
    return rss / 2**20 if rss else None


def learner_points(samples: list[dict], warmup_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, learner MB) of the samples after warm-up that caught the learner."""
    pts = [(s["t"], s["learner_mb"]) for s in samples if s["t"] >= warmup_s and s["learner_mb"] is not None]
    return np.array(pts, dtype=float).reshape(-1, 2).T


def slope_mb_per_min(samples: list[dict], warmup_s: float) -> float | None:
    t, mb = learner_points(samples, warmup_s)
    if len(t) < 3:
        return None
    return float(np.polyfit(t / 60.0, mb, 1)[0])


def window_slopes(samples: list[dict], warmup_s: float, window_s: float) -> dict:
    """The learner's RSS in whole `window_s` windows after warm-up: each window's peak, median and floor
    (MB), and the least-squares slope of each series over the windows' midpoints (MB/min; None with
    fewer than 3 windows)."""
    t, mb = learner_points(samples, warmup_s)
    whole = int((t.max() - warmup_s) // window_s) if len(t) else 0  # the last, partial window is left out
    idx = ((t - warmup_s) // window_s).astype(int)
    wins = [i for i in range(whole) if (idx == i).sum() >= 2]
    mid = np.array([warmup_s + (i + 0.5) * window_s for i in wins]) / 60.0
    out: dict = {"slopes": {}, "windows_mb": {}}
    for name, f in (("peak", np.max), ("median", np.median), ("floor", np.min)):
        series = [float(f(mb[idx == i])) for i in wins]
        out["windows_mb"][name] = [round(v, 1) for v in series]
        out["slopes"][name] = float(np.polyfit(mid, series, 1)[0]) if len(wins) >= 3 else None
    return out


class Schedule:
    """The event cycle; an event that cannot happen now (no actor to kill, none added) is skipped."""

    def __init__(self, address: str, freeze_s: float, log_dir: Path):
        self.address, self.freeze_s, self.log_dir = address, freeze_s, log_dir
        self.added: subprocess.Popen | None = None
        self.frozen: tuple[psutil.Process, float] | None = None
        self.done: list[dict] = []
        self.n = 0

    def thaw(self, now: float) -> None:
        if self.frozen and now >= self.frozen[1]:
            try:
                self.frozen[0].send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
            self.frozen = None

    def next(self, t: float, actors: list[psutil.Process], serving: set[int]) -> None:
        """The cycle's next event. A kill or freeze waits (asked again at the next sample) while no actor
        serves the learner: one still starting its engine on a starved CPU holds no work and has
        `transport.join_timeout_s`, so it is not presumed dead and nothing the soak checks would follow
        (2026-11-28, the AVX2-only pace: one killed 10 s after its start, one frozen before its group). A
        remove waits likewise for the added actor to serve."""
        kind = CYCLE[self.n % len(CYCLE)]
        ready = [a for a in actors if a.pid in serving]
        if kind in ("kill", "freeze") and actors and not ready:
            return
        if kind == "remove" and self.added is not None and self.added.pid not in serving:
            return  # the added actor leaves once it serves: one removed while starting joined nothing (2026-11-29)
        self.n += 1
        target = ready[self.n % len(ready)] if ready else None
        if kind == "kill" and target is not None:
            target.send_signal(signal.SIGKILL)
        elif kind == "freeze" and target is not None and self.frozen is None:
            target.send_signal(signal.SIGSTOP)
            self.frozen = (target, time.time() + self.freeze_s)
        elif kind == "add" and self.added is None:
            log = open(self.log_dir / f"added-actor-{self.n}.log", "w")
            self.added = subprocess.Popen([sys.executable, "-m", "exgrpo_async.launcher.cli", "actor", "--learner",
                                           self.address], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        elif kind == "remove" and self.added is not None:
            self.added.terminate()
            self.added.wait(timeout=120)
            self.added = None
        else:
            return
        self.done.append({"t": round(t, 1), "event": kind})

    def close(self) -> None:
        self.thaw(float("inf"))
        if self.added is not None:
            self.added.terminate()
            self.added.wait(timeout=120)


def planned_events(minutes: float, every: float) -> int:
    """How many events the schedule holds: one each `every` seconds, none in the last every/2 seconds of
    `minutes`, so that training is seen to go on after the last one."""
    return max(0, math.ceil((minutes * 60 - every / 2) / every) - 1)


def stop_due(t: float, minutes: float, every: float, done: list[dict], planned: int) -> bool:
    """Whether the run should end now: `minutes` have passed and every planned event happened at least
    every/2 seconds ago. A kill or freeze waits for an actor serving the learner (`Schedule.next`), so on a
    starved CPU the events fall behind the clock; the run goes on until they are done, LATE_S at most
    (the report then shows the events missing)."""
    if t < minutes * 60:
        return False
    caught_up = len(done) >= planned and (not done or t >= done[-1]["t"] + every / 2)
    return caught_up or t >= minutes * 60 + LATE_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, help="how long to train (required unless --from)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between events")
    ap.add_argument("--freeze", type=float, default=15.0, help="seconds an actor stays frozen")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--warmup", type=float, default=5.0, help="minutes left out of the RSS slope")
    ap.add_argument("--window", type=float, default=5.0, help="minutes per window of the peak/median/floor slopes")
    bench.add_out(ap, "soak", help="folder for the run and soak.json")
    ap.add_argument("--from", dest="source", help="a soak.json: print its figures again from its samples, run nothing")
    a, extra = ap.parse_known_args()
    if a.source:
        if extra:
            ap.error(f"--from re-reads a finished run; these would be ignored: {' '.join(extra)}")
        res = json.loads(Path(a.source).read_text())
        a.minutes = res["minutes"]
        print_table(a, {**res, **memory_figures(a, res["samples"])})
        return
    if a.minutes is None:
        ap.error("--minutes is required")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    restarts = int(a.minutes * 60 / a.every) + 3
    cmd = [sys.executable, "-m", "exgrpo_async.launcher.cli", "train", f"output_dir={out / 'runs'}", "learner.max_steps=1000000",
           f"learner.max_seconds={a.minutes * 60 + SAFETY_S}", "data.eval_file=none", f"actor.max_restarts={restarts}",
           "transport.actor_timeout_s=10", "learner.checkpoint_every=0", *extra]
    with open(out / "train.log", "w") as log:
        train = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        launcher = psutil.Process(train.pid)
        t0, samples, schedule, stop_sent = time.time(), [], None, False
        planned = planned_events(a.minutes, a.every)
        try:
            while train.poll() is None:
                time.sleep(a.sample)
                run = next(iter(sorted((out / "runs").glob("run-*"))), None)
                if schedule is None and run is not None and (run / "learner.json").exists() and \
                        (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size:
                    address = json.loads((run / "learner.json").read_text())["address"]
                    schedule, t0 = Schedule(address, a.freeze, out), time.time()  # the clock starts at step 1
                if schedule is None:
                    continue
                t = time.time() - t0
                if not stop_sent and stop_due(t, a.minutes, a.every, schedule.done, planned):
                    (run / "STOP").touch()  # the learner ends after its current step (and removes the file)
                    stop_sent = True
                learner, actors = roles(launcher)
                schedule.thaw(time.time())
                if len(schedule.done) < planned and t >= a.every * (len(schedule.done) + 1):
                    schedule.next(t, actors, serving_pids(out / "train.log"))
                steps = (run / "metrics.jsonl").read_text().count("\n")
                procs = actors + ([psutil.Process(schedule.added.pid)] if schedule.added else [])
                samples.append({"t": round(t, 1), "steps": steps, "learner_mb": rss_mb(learner) if learner else None,
                                "actors_mb": [m for m in map(rss_mb, procs) if m is not None]})
        finally:
            if schedule is not None:
                schedule.close()
            if train.poll() is None:
                train.terminate()
            train.wait(timeout=600)
    report(a, out, train.returncode, samples, schedule.done if schedule else [])


def report(a, out: Path, returncode: int, samples: list[dict], events: list[dict]) -> None:
    (run,) = sorted((out / "runs").glob("run-*"))
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    log_text = (out / "train.log").read_text()
    actor_mb = [m for s in samples for m in s["actors_mb"]]
    res = {
        "minutes": a.minutes, "returncode": returncode, "steps": len(rows),
        "steps_per_min": len(rows) / max(1e-9, summary.get("rl_seconds", a.minutes * 60) / 60),
        **memory_figures(a, samples),
        "actor_rss_mb_min_max": [min(actor_mb, default=None), max(actor_mb, default=None)],
        "events": {k: sum(e["event"] == k for e in events) for k in CYCLE},
        "restarts": log_text.count("restarting it"),
        **{k: summary.get(k) for k in ("questions_unaccounted", "questions_dispatched", "questions_trained",
                                       "stale_dropped", "actors_lost", "actors_joined", "work_reissued",
                                       "work_released", "bad_messages", "skipped_steps", "fingerprints_checked",
                                       "weight_fingerprint_mismatches", "fingerprint_rejected_groups")},
        "samples": samples, "event_log": events,
    }
    bench.write_json(out / "soak.json", res, say=False)
    print_table(a, res)
    print(f"wrote {out / 'soak.json'}")


def memory_figures(a, samples: list[dict]) -> dict:
    windows = window_slopes(samples, a.warmup * 60, a.window * 60)
    return {"learner_rss_slope_mb_per_min": slope_mb_per_min(samples, a.warmup * 60),
            "learner_rss_window_slopes_mb_per_min": windows["slopes"], "learner_rss_windows_mb": windows["windows_mb"],
            "learner_rss_mb_first_last": [next((s["learner_mb"] for s in samples if s["learner_mb"]), None),
                                          next((s["learner_mb"] for s in reversed(samples) if s["learner_mb"]), None)]}


def print_table(a, res: dict) -> None:
    print(f"| soak {a.minutes:g} min (warm-up {a.warmup:g} min, windows of {a.window:g} min) | value |\n|---|---|")
    for k, v in res.items():
        if k in ("samples", "event_log"):
            continue
        if isinstance(v, dict) and k != "events":
            v = {n: (round(x, 3) if isinstance(x, float) else x) for n, x in v.items()}
        print(f"| {k} | {round(v, 3) if isinstance(v, float) else v} |")


if __name__ == "__main__":
    main()
