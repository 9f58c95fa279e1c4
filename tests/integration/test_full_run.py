"""The real entry point end to end: `exgrpo-async train` with a learner and 2 vLLM actor processes.

Short runs on the toy task (a 120-second warm start; learning itself is shown by the demo, not here):
versions advance once per step, rewards and losses are finite, every metrics field is present, the
final model loads in transformers, and SIGTERM stops every child process.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import time
from pathlib import Path

import pytest

from exgrpo_async import precision
from exgrpo_async.toy.task import TEST_KINDS, make_test_set
from tests.integration.helpers import actor_pids, children_of, cli, log_excerpt
from tests.reward_fns import PROBE_LOG_ENV
from tests.unit.test_trackers import tensorboard_scalars, wandb_history

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # real `train` runs: 1-4 min each

FIELDS = {"step", "policy_version", "reward_mean", "pass_at_1", "loss", "grad_norm", "tokens_generated", "rollouts",
          "staleness_mean", "staleness_max", "sync_seconds", "step_seconds"}


# The switch threshold of the shared run: the first step with any correct sample (every step of the warm
# start has some, 64 samples at a pass@1 of about 0.02-0.2) switches ExGRPO on, so the switch is sure to
# happen and early enough for replay to reach batches; the rule itself (the first step above it, for
# good) is what the run's rows are checked against.
START = 0.0
STEPS = 14  # replay reaches batches ~3 steps after the switch: collect, select, then queued work drains
EVAL_QUESTIONS = 48
# bf16 where the CPU has it in hardware (as the demo's "auto" would pick it, without the timing probe)
RUN_PRECISION = "bf16" if precision.native_cpu_bf16(
    precision.visible_flags(precision.cpu_flags(Path("/proc/cpuinfo").read_text())), platform.machine()) else "none"


@pytest.fixture(scope="module")
def exgrpo_run(small, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `train` run that several tests assert on: 2 actors, ExGRPO on, TensorBoard and offline W&B,
    held-out evaluation before and after; the bf16 learner where this CPU computes bf16 in hardware (the
    fixtures pin fp32; on an AVX2-only CPU bf16 autocast is 7 times fp32's time, and the bf16 step is
    tested there by tests/integration/test_learner_ranks.py)."""
    out = tmp_path_factory.mktemp("exgrpo_run") / "runs"
    train = with_long_prompts(small, out.parent, "train", 3)
    inductor = out.parent / "inductor"  # Inductor's cache: what the run's processes compiled (nothing, on CPU)
    proc = subprocess.run(cli(["train", *small, f"learner.max_steps={STEPS}", f"output_dir={out}",
                               f"data.train_files={json.dumps([str(train)])}",
                               f"data.eval_file={with_long_prompts(small, out.parent, 'eval', 2)}",
                               'metrics.trackers=["tensorboard", "wandb"]', "metrics.wandb_mode=offline",
                               f"learner.mixed_precision={RUN_PRECISION}", "exgrpo.enabled=true",
                               f"exgrpo.start_threshold={START}", "learner.questions_per_step=16"]),
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    return proc, run_dir


def eval_slice(small: list[str], folder: Path) -> Path:
    """The toy test set's first EVAL_QUESTIONS questions: the evaluations before and after are what is
    checked, not the policy's accuracy (200 questions took 18 s per evaluation)."""
    from exgrpo_async.config_io import load_config
    from exgrpo_async.runs import resolve_toy

    full = Path(resolve_toy(load_config(None, small)).data.eval_file)
    out = folder / "toy-test-slice.jsonl"
    out.write_text("".join(full.read_text().splitlines(keepends=True)[:EVAL_QUESTIONS]))
    return out


def with_long_prompts(small: list[str], folder: Path, pool: str, n: int) -> Path:
    """The toy's training file (whole: the same sampling order) or eval_slice's questions, then `n` whose
    prompts are longer than the model's 256-token context: before the learner left them out, vLLM refused
    each request holding one and every actor exited, restarts and all."""
    from exgrpo_async.config_io import load_config
    from exgrpo_async.runs import resolve_toy

    toy = resolve_toy(load_config(None, small))
    first = Path(toy.data.train_files[0]) if pool == "train" else eval_slice(small, folder)
    long = [{"problem": "1+" * (150 + i) + "1=", "answer": str(151 + i), "kind": "add2"} for i in range(n)]
    out = folder / f"{pool}-with-long-prompts.jsonl"
    out.write_text(first.read_text() + "".join(json.dumps(row) + "\n" for row in long))
    return out


def test_train_runs_end_to_end(exgrpo_run):
    proc, run_dir = exgrpo_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((run_dir / "config.json").read_text())
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert FIELDS <= r.keys()
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "loss", "grad_norm"))
        assert r["rollouts"] == 16 * 4 and r["staleness_max"] <= config["learner"]["max_staleness"]
    assert config["learner"]["max_steps"] == STEPS
    assert (config["learner"]["mixed_precision"], config["model"]["dtype"]) == (RUN_PRECISION, "float32")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["before"]["versions"] == [0] and summary["after"]["versions"] == [STEPS]
    # the prompts too long for the context (256 tokens less 64 for the completion) left out, and counted
    assert summary["prompts_too_long"] == {"train": 3, "eval": 2}
    assert summary["before"]["questions"] == summary["after"]["questions"] == EVAL_QUESTIONS
    assert ("3 of 20003 training questions skipped: prompts longer than 192 tokens (model.max_model_len=256"
            in proc.stderr)
    assert summary["actors_lost"] == 0 and "restarting it" not in proc.stderr
    assert summary["syncs"] >= 2 * 3  # each actor received version 0 and at least two later ones it used
    # the best weights by held-out score (one source here, so its accuracy): only the final eval ran
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert best == summary["best"] and best["step"] == STEPS and best["score"] == summary["after"]["accuracy"]
    assert "held-out accuracy" in proc.stdout
    report = run_dir / "report" / "report.md"  # written by the learner at the end, its path printed
    assert f"report: {report}" in proc.stdout and "![Reward and pass@1](reward.png)" in report.read_text()
    assert (run_dir / "report" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.tie_word_embeddings
    # the trackers got the same rows as metrics.jsonl, and the held-out evaluations before and after
    tb, wb = tensorboard_scalars(run_dir), wandb_history(run_dir)
    assert [s for s, _ in tb["reward_mean"]] == list(range(1, STEPS + 1))
    assert [v for _, v in tb["loss"]] == [pytest.approx(r["loss"], rel=1e-6) for r in rows]
    assert [wb[r["step"]]["loss"] for r in rows] == [r["loss"] for r in rows]
    assert wb[0]["eval/accuracy"] == summary["before"]["accuracy"]
    assert wb[STEPS]["eval/accuracy"] == summary["after"]["accuracy"]
    # vLLM's start-up noise stays out of the user's terminal (`--log-level debug` shows it)
    assert "set_num_threads" not in proc.stderr and "LD_PRELOAD" not in proc.stderr
    # nothing was compiled: the learner's regions are eager on CPU ("auto"), and the actors run vLLM's
    # torch.compile'd helpers eagerly (actors/engine.py `no_compiling_on_cpu`: Inductor took 3.7-21 s of each
    # engine's first generate)
    compiled = [p.name for p in (run_dir.parent.parent / "inductor").rglob("*") if p.suffix in (".so", ".cpp", ".py")]
    assert not compiled, compiled


def test_stream_actors_train_through_a_corrupted_weight_load_and_verifier_timeouts(small, tmp_path):
    """The stream actor loop (`actor.engine.kind=stream`: in-flight weight updates) in a real run, with two
    faults, taking its rewards from a custom function (`actor.verifier.function`). The fault drill
    corrupts one weight after the actor's third load: its fingerprint must be refused (counted once,
    logged), its weights sent again, any group it generated with them re-issued rather than trained on.
    The reward function (tests/reward_fns.py:slow_on_some) is exact match mapped to 0.25 / 0.75, values
    math-verify never gives, each call logged with its row; it hangs on every eighth training question:
    each such completion times out (reward 0), and the learner counts every one it trains on. The
    held-out evaluations before and after score with the same function. The run must finish with its
    books balanced."""
    out, steps, probe = tmp_path / "runs", 8, tmp_path / "rewards.jsonl"
    # a small held-out file whose rows name their data_source (the toy question kind)
    held_out = [dict(row, data_source=row["kind"]) for row in make_test_set(seed=1, per_kind=3)]
    eval_file = tmp_path / "held_out.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in held_out))
    proc = subprocess.run(cli(["train", *small, f"learner.max_steps={steps}", "actor.num_actors=1",
                               "actor.engine.kind=stream", "actor.fault_corrupt_load_at_syncs=[3]",
                               "actor.verifier.function=tests.reward_fns:slow_on_some", "actor.verifier.timeout_s=0.5",
                               "actor.verifier.workers=2",
                               f"data.eval_file={eval_file}", "metrics.port=none", f"output_dir={out}"]),
                          cwd=REPO, env=dict(os.environ, **{PROBE_LOG_ENV: str(probe)}), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["questions_unaccounted"] == 0
    assert summary["questions_trained"] == steps * 8
    assert summary["update_stall_seconds_mean"] is not None  # in-flight updates happened (the stream loop)
    assert proc.stderr.count("fault drill: corrupting the load") == 1
    assert summary["weight_fingerprint_mismatches"] == 1, summary
    assert "does not run the weights of version" in proc.stderr
    # every load was checked (its fingerprint comes with the next request), and all but the corrupted
    # one matched: the first three loads and the third's repeat at least (not one per step: an actor
    # busy while the learner made two steps loads only the newer version; seen under load)
    assert summary["fingerprints_checked"] == summary["syncs"] >= 4 and summary["fingerprints_unchecked"] == 0
    # a hanging question times out on all its samples: the trained count is a multiple of the group size
    calls = [json.loads(line) for line in probe.read_text().splitlines()]
    hung = sum(1 for c in calls if c["reward"] is None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timeouts = rows[-1]["verify_timeouts_total"]
    assert 4 <= timeouts <= hung and timeouts % 4 == 0, (timeouts, hung)
    assert [r["verify_timeouts_total"] for r in rows] == sorted(r["verify_timeouts_total"] for r in rows)

    # the rewards are the function's: 0.25 or 0.75 for each completion, 0 for each timed out one
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["verify_errors_total"] == 0 for r in rows), rows
    before = 0
    for r in rows:
        n, timed_out, before = r["rollouts"], r["verify_timeouts_total"] - before, r["verify_timeouts_total"]
        assert 0.25 * (n - timed_out) / n <= r["reward_mean"] <= 0.75 * (n - timed_out) / n, (r, timed_out)
    assert {c["reward"] for c in calls} <= {0.25, 0.75, None}
    for c in calls:  # the row the function is given
        row = c["row"]
        assert set(row) == {"question_id", "data_source", "answer", "prompt", "purpose"}, row
        assert isinstance(row["question_id"], int) and row["purpose"] in ("train", "eval")
        assert all(isinstance(row[k], str) and row[k] for k in ("data_source", "answer", "prompt")), row
    train = [c for c in calls if c["row"]["purpose"] == "train"]
    evals = [c for c in calls if c["row"]["purpose"] == "eval"]
    assert len(train) >= sum(r["rollouts"] for r in rows)
    assert {c["row"]["data_source"] for c in evals} == set(TEST_KINDS) == set(summary["after"]["by_source"])
    assert {c["row"]["answer"] for c in evals} == {row["answer"] for row in held_out}
    # Before and after training the learner scored the N held-out questions sampled (1 sample) and greedy:
    # its accuracies are exactly the means of the function's first and last 2N eval rewards.
    n = len(held_out)
    assert len(evals) == 4 * n
    for ev, part in ((summary["before"], evals[:2 * n]), (summary["after"], evals[2 * n:])):
        assert sum(c["reward"] for c in part) == pytest.approx(n * (ev["accuracy"] + ev["greedy_accuracy"]))


def test_sigterm_stops_every_child(small, tmp_path):
    out = tmp_path / "runs"
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(cli(["train", *small, "learner.max_steps=100000", "data.eval_file=none",
                                 "actor.num_actors=1", f"output_dir={out}"]),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        # train starts its actors beside the learner, before it listens: they import vLLM meanwhile
        deadline = time.monotonic() + 60
        while proc.poll() is None and not actor_pids(proc.pid):
            assert time.monotonic() < deadline, "no actor started"
            time.sleep(0.1)
        (run_dir,) = out.glob("run-*")
        assert not (run_dir / "learner.json").exists(), "the actors started only once the learner listened"
        deadline = time.monotonic() + 300
        metrics = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(out.glob("*/metrics.jsonl"))
            if found and found[0].read_text().count("\n") >= 1:  # training: SIGTERM comes mid-run
                metrics = found[0]
                break
            time.sleep(1)
        assert metrics is not None, "training never started"
        kids = children_of(proc.pid)
        assert len(kids) >= 3  # learner, actor, its verifier worker
        role_nice = {}  # the CPU layout: actors run actor.nice (10) nicer than the learner
        for k in kids:
            try:
                argv = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")
                stat = Path(f"/proc/{k}/stat").read_text()
            except FileNotFoundError:
                continue
            if b"exgrpo_async.launcher.cli" in argv:
                role_nice[argv[argv.index(b"exgrpo_async.launcher.cli") + 1].decode()] = int(stat.rsplit(")", 1)[1].split()[16])
        assert role_nice.get("actor") == role_nice.get("learner", -99) + 10, role_nice
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        # the launcher's own exit for an interrupt, and its line (a crash would be 1, or a signal's code)
        assert proc.returncode == 130, log_excerpt(tmp_path / "train.log")
        assert "interrupted; every child process was stopped" in (tmp_path / "train.log").read_text()
        time.sleep(1)
        alive = [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2]]
        assert not alive, f"orphans left: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_exgrpo_run_switches_on_and_replays_experience(exgrpo_run):
    _, run_dir = exgrpo_run
    steps = STEPS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trace = [(r["step"], r["pass_at_1"], r["exgrpo_mixed"], r["buffer_trajectories"], r["experience_questions"])
             for r in rows]
    # the switch (learner/maths/experience.py): mixed from the first step whose batch pass@1 exceeds START, for good;
    # the batch of that step was assembled before it, so collection starts with the next one
    assert any(r["pass_at_1"] > START for r in rows), f"no step passed {START}: {trace}"
    fired = next(i for i, r in enumerate(rows) if r["pass_at_1"] > START)
    assert [r["exgrpo_mixed"] for r in rows] == [i >= fired for i in range(steps)], (fired, trace)
    assert [r["exgrpo_collecting"] for r in rows] == [i > fired for i in range(steps)], (fired, trace)
    assert max(r["buffer_trajectories"] for r in rows) > 0, f"nothing collected: {trace}"
    replayed = [r for r in rows if r["experience_questions"] > 0]
    assert replayed, f"no experience question reached a batch: {trace}"
    # an experience group whose fresh samples are all correct too has zero advantages and is not forwarded
    # (a lone experience group in a batch can be that: seen in CI), so look at the batches that trained replay
    trained = [r for r in replayed if r["replay_token_frac"] > 0]
    assert trained, f"replayed trajectories never reached the loss: {trace}"
    r = trained[0]
    assert r["replay_w_max"] is not None and math.isfinite(r["replay_w_max"])
    assert sum(r["experience_by_bucket"].values()) == r["experience_questions"]
    assert all(math.isfinite(x["loss"]) for x in rows)
