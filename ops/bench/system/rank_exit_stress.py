"""Stress the end of a 2-rank learner in the real topology: how many of N `train` runs abort.

Each round is a real `exgrpo-async train` with `learner.world_size=2` (FSDP2 on gloo, the lead rank
serving the actors) and one vLLM actor on the toy task, the fault drills' topology, ending one of three
ways in turn:
- actor_lost: the actor is killed with SIGKILL after the first step (presumed dead, its work re-issued,
  the launcher starts a replacement); the run finishes its steps: exit 0 expected;
- lead_busy: a clean finish with the held-out evaluation on, so the lead works for seconds (final
  evaluation, model, report) after the follower has read "stop": exit 0 expected;
- sigterm: the launcher gets SIGTERM after the second step: exit 130 expected, every rank stopped.
A round counts as an abort when a rank died of SIGABRT (or exit 134), or the log shows what an abort or
a broken collective prints ("terminate called", "Aborted", "Connection closed by peer"); as a rank error
when the launcher named a rank's exit that the round's ending does not explain (any non-zero exit after
a clean finish; anything but SIGTERM's 143 after an interrupt); as wrong when `train`'s own exit code is
not the expected one. A table and JSON are written to --out, with the tail of every failed round's log.

The "bare" ending skips train: two processes do what `exgrpo-async learner` does with learner.world_size=2,
minus the actors (join the group, shard the toy policy, two steps, the lead says stop, both close the group
and exit through `learner.ranks.end_rank_process`); any exit but 0 counts. "plain_exit" (never by default)
ends them through the interpreter's finalization instead, which shows the abort `end_rank_process` avoids
(learner/ranks.py explains it).

    .venv/bin/python ops/bench/system/rank_exit_stress.py --rounds 30 [--out bench_out/rank_exit] [--endings sigterm]
    .venv/bin/python ops/bench/system/rank_exit_stress.py --rounds 40 --endings bare     # [or plain_exit]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402
from bench import REPO  # noqa: E402

ENDINGS = ("actor_lost", "lead_busy", "sigterm", "bare")
BARE = ("bare", "plain_exit")  # two learner ranks without train: through end_rank_process, or finalization
ABORT_SIGNS = ("terminate called", "Aborted", "Connection closed by peer")
# the integration tests' toy policy and precision (tests/integration/conftest.py), so its cache is reused
BASE = [f"toy.cache_dir={Path('~/.cache/exgrpo_async/tests').expanduser()}", "toy.sft_steps=600",
        "learner.questions_per_step=8", "rollout.samples_per_question=4", "rollout.questions_per_request=4",
        "rollout.eval_samples=1", "model.dtype=float32", "learner.mixed_precision=none", "learner.world_size=2",
        "actor.num_actors=1", "metrics.port=none", "transport.actor_timeout_s=10", "transport.heartbeat_s=0.5"]


def steps_done(out: Path) -> int:
    found = list(out.glob("run-*/metrics.jsonl"))
    return len(found[0].read_text().splitlines()) if found else 0


def actor_pids(launcher: int) -> list[int]:
    """The launcher's `exgrpo-async actor` children."""
    pids = []
    for child in psutil.Process(launcher).children():
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "exgrpo_async.launcher.cli" in cmd and "actor" in cmd:
            pids.append(child.pid)
    return pids


def rank_main(model: str, plain_exit: bool) -> int:
    """One of the bare round's two learner ranks (RANK, WORLD_SIZE and MASTER_* from the environment)."""
    import torch

    from exgrpo_async.config import RunConfig
    from learner.maths.batch import Seq
    from learner.maths.update import StepSettings
    from learner.policy import Policy
    from learner.ranks import Ranks, end_rank_process

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype, cfg.learner.mixed_precision = model, "float32", "none"
    cfg.learner.world_size, cfg.learner.device, cfg.learner.micro_batch_sequences = 2, "cpu", 3
    torch.set_num_threads(1)
    ranks = Ranks.from_env(2, "cpu", 60.0)
    try:
        torch.manual_seed(0)
        policy = Policy(cfg, ranks, torch.device("cpu"))
        if ranks.lead:
            rng = random.Random(0)
            for step in range(2):
                comps = [[rng.randrange(4, 90) for _ in range(rng.randrange(2, 12))] + [2] for _ in range(16)]
                seqs = [Seq([1, 5, 6], c, torch.full((len(c),), -2.0), rng.choice([-0.5, 0.5]), 0, i // 4,
                            False, False) for i, c in enumerate(comps)]
                policy.update(seqs, 4, StepSettings(clip=0.2), step)
            policy.stop()
        else:
            policy.follow()
    finally:
        ranks.close()
    if plain_exit:
        return 0
    end_rank_process(0)


def bare_round(ending: str, model: Path, timeout_s: float) -> dict:
    """Two learner ranks, no train: their exit codes and what they printed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--rank-of", str(model)] + (["--plain-exit"] if ending == "plain_exit" else [])
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(r)}) for r in range(2)]
    errs, timed_out = [], False
    for p in procs:
        try:
            errs.append(p.communicate(timeout=timeout_s)[1])
        except subprocess.TimeoutExpired:
            p.kill()
            errs.append(p.communicate()[1])
            timed_out = True
    text = "\n".join(errs)
    return {"ending": ending, "rc": max(abs(p.returncode) for p in procs), "timed_out": timed_out,
            "seconds": round(time.monotonic() - t0, 1), "acted": True, "expected_rc": 0,
            "abort": any(s in text for s in ABORT_SIGNS) or any(p.returncode in (134, -6) for p in procs),
            "rank_errors": [f"rank {r}: code {p.returncode}" for r, p in enumerate(procs) if p.returncode != 0],
            "tail": text[-2000:]}


def fresh_round_folder(out: Path, i: int) -> Path:
    """Round i's folder, emptied: an earlier invocation's run left there would be read as this round's
    steps (a "sigterm" round then signals train at once and reads its exit as wrong)."""
    folder = out / f"round-{i:03d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder


def one_round(ending: str, out: Path, timeout_s: float) -> dict:
    """Run one `train` that ends as `ending` says; its verdict."""
    steps = {"actor_lost": 5, "lead_busy": 3, "sigterm": 100000}[ending]
    extra = [] if ending == "lead_busy" else ["data.eval_file=none"]
    log_path = out / "train.log"
    cmd = [sys.executable, "-m", "exgrpo_async.launcher.cli", "train", *BASE, f"learner.max_steps={steps}",
           f"output_dir={out / 'runs'}", *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    acted = False
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                return {"ending": ending, "rc": None, "timed_out": True, "seconds": timeout_s}
            done = steps_done(out / "runs")
            if not acted and ending == "actor_lost" and done >= 1 and actor_pids(proc.pid):
                os.kill(actor_pids(proc.pid)[0], signal.SIGKILL)
                acted = True
            if not acted and ending == "sigterm" and done >= 2:
                proc.send_signal(signal.SIGTERM)
                acted = True
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    named = [(int(k), how) for k, how in re.findall(r"learner rank (\d+) exited with (code -?\d+|signal \d+[^;\n]*)", text)]
    explained = ("code 143",) if ending == "sigterm" else ()
    return {"ending": ending, "rc": proc.returncode, "timed_out": False, "seconds": round(time.monotonic() - t0, 1),
            "acted": acted or ending == "lead_busy", "expected_rc": 130 if ending == "sigterm" else 0,
            "abort": any(s in text for s in ABORT_SIGNS) or any(how in ("code 134", "code -6") or how.startswith("signal 6")
                                                                 for _, how in named),
            "rank_errors": [f"rank {k}: {how}" for k, how in named if how not in explained],
            "tail": text[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    bench.add_out(ap, "rank_exit", help="folder for the rounds and rank_exit.json")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a round may take before it counts as hung")
    ap.add_argument("--endings", default=",".join(ENDINGS), help="the endings to cycle through, comma-separated "
                    f"(of {', '.join(ENDINGS + ('plain_exit',))})")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: one bare rank on this model
    ap.add_argument("--plain-exit", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of, args.plain_exit)
    endings = args.endings.split(",")
    if not endings or not set(endings) <= set(ENDINGS + ("plain_exit",)):
        ap.error(f"--endings: choose from {', '.join(ENDINGS + ('plain_exit',))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "bare-model"
    if set(endings) & set(BARE) and not (model / "config.json").exists():
        from exgrpo_async.toy.task import build_model, build_tokenizer

        build_tokenizer(model)
        build_model(0).save_pretrained(str(model))
    rounds = []
    for i in range(args.rounds):
        ending = endings[i % len(endings)]
        folder = fresh_round_folder(out, i)
        r = bare_round(ending, model, args.timeout) if ending in BARE else one_round(ending, folder, args.timeout)
        r["wrong_rc"] = r["timed_out"] or r["rc"] != r["expected_rc"] or not r["acted"]
        if not (r["abort"] or r["rank_errors"] or r["wrong_rc"]):
            del r["tail"]
        rounds.append(r)
        print(f"round {i} {ending}: rc {r['rc']} in {r['seconds']} s; abort {r['abort']}; "
              f"rank errors {r['rank_errors']}", flush=True)
    table = ["| ending | rounds | aborts | rank errors | wrong exit code or hung | median s |", "|---|---|---|---|---|---|"]
    for ending in ENDINGS + ("plain_exit",):
        rs = [r for r in rounds if r["ending"] == ending]
        if rs:
            secs = sorted(r["seconds"] for r in rs)
            table.append(f"| {ending} | {len(rs)} | {sum(r['abort'] for r in rs)} | "
                         f"{sum(bool(r['rank_errors']) for r in rs)} | {sum(r['wrong_rc'] for r in rs)} | "
                         f"{secs[len(secs) // 2]:.0f} |")
    print("\n".join(table))
    bench.write_json(out / "rank_exit.json", {"rounds": rounds, "table": table}, indent=1, say=False)
    return bench.exit_code(*(not (r["abort"] or r["rank_errors"] or r["wrong_rc"]) for r in rounds))


if __name__ == "__main__":
    sys.exit(main())
