"""`exgrpo-async train`: start one learner and N actors on this machine, watch them, tear them down.

The learner and every actor are separate OS processes started exactly as a user would start them on
several hosts (`exgrpo-async learner` / `exgrpo-async actor --learner ADDR [--keys DIR]`); this launcher only adds
local conveniences: the toy policy, the run folder, one CPU core per actor, and clean shutdown.
A custom reward function (`actor.verifier.function`) is imported here first, before anything starts, so a
typo is one clear line and exit code 2, not actors failing one after another; so are data files, the model
folder, the output folder and fixed ports checked (exgrpo_async/preflight.py).
Shutdown: Ctrl-C or SIGTERM reaches every child (SIGTERM, then SIGKILL after a grace period); children
also get SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so no process is orphaned.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from exgrpo_async import precision, preflight
from exgrpo_async.config import RunConfig
from exgrpo_async.custom_reward import RewardFunctionError, load_reward_function
from exgrpo_async.layout import balance, resolve
from exgrpo_async.placement import PlacementError, plan, visible

log = logging.getLogger("exgrpo_async.launch")
GRACE_S = 20.0


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: Ctrl-C still reaches the whole process group
        pass


def resolve_toy(cfg: RunConfig) -> RunConfig:
    """Replace model.path="toy" by the cached warm-started policy and its train/test files (the test file
    only where data.eval_file was left unset: an explicit `data.eval_file=none` turns evaluation off)."""
    if cfg.model.path != "toy":
        return cfg
    from exgrpo_async.toy import PROMPT_TEMPLATE, ensure_toy_assets

    paths = ensure_toy_assets(Path(cfg.toy.cache_dir), cfg.toy.seed, cfg.toy.sft_steps, threads=cfg.toy.sft_threads)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(paths["model"])
    cfg.data.train_files = cfg.data.train_files or [str(paths["train"])]
    if cfg.data.eval_file is None and "eval_file" not in cfg.data.model_fields_set:
        cfg.data.eval_file = str(paths["test"])
    cfg.data.prompt_template = PROMPT_TEMPLATE
    return cfg


def new_run_dir(output_dir: str) -> Path:
    base = Path(output_dir)
    run_dir = base / time.strftime("run-%Y%m%d-%H%M%S")
    n = 1
    while run_dir.exists():
        run_dir = base / f"{time.strftime('run-%Y%m%d-%H%M%S')}-{n}"
        n += 1
    run_dir.mkdir(parents=True)
    return run_dir


def placement(cores: list[int], num_actors: int, pin: bool, per_actor: int = 1) -> tuple[set[int] | None, list[list[int] | None]]:
    """(the learner's cores, each local actor's cores); None leaves placement to the OS. Actors take
    `per_actor` cores each (a tensor-parallel CPU engine: one per worker) from core 0 up, round robin
    if there are more actors than cores, and the cores left over go to the learner, so training never
    steals an actor's core; one core, or `pin=False`, pins nothing."""
    if not pin or len(cores) < 2:
        return None, [None] * num_actors
    if per_actor > len(cores):
        raise ValueError(f"actor.engine.tensor_parallel_size={per_actor} on CPU needs a core per worker; "
                         f"this machine gives {len(cores)}")
    used = num_actors * per_actor
    spare = set(cores[used:]) if len(cores) > used > 0 else None
    slots = len(cores) // per_actor
    return spare, [cores[(i % slots) * per_actor:(i % slots + 1) * per_actor] for i in range(num_actors)]


def gpu_core_slices(cores: list[int], num_actors: int, pin: bool) -> tuple[set[int] | None, list[list[int] | None]]:
    """CPU cores for a GPU run: each actor an equal contiguous slice of the node's cores (its vLLM engine
    core, TP workers and verifier workers all run there), the learner the first slice and what does not
    divide. A GPU actor pinned to one core would share it with all of those, and its verifier would run
    out of its deadline (rewards silently 0). Fewer cores than processes, or `pin=False`: no pinning."""
    if not pin or num_actors == 0 or len(cores) < num_actors + 1:
        return None, [None] * num_actors
    k = len(cores) // (num_actors + 1)
    return set(cores[:k]) | set(cores[(num_actors + 1) * k:]), [cores[(i + 1) * k:(i + 2) * k] for i in range(num_actors)]


def child_setup(cores: set[int] | None = None, nice: int = 0):
    """What a child runs before its program: die with the launcher, its cores, its priority."""
    def setup() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)
        if nice:
            os.nice(nice)

    return setup


def _spawn(args: list[str], env: dict, cores: set[int] | None = None, nice: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exgrpo_async.cli", *args], env=env,
                            preexec_fn=child_setup(cores, nice))


def learner_rank_envs(env: dict, world_size: int) -> list[dict]:
    """The environment of each learner rank on this machine, as torchrun would set it (a free port on
    127.0.0.1 for the rendezvous); world size 1 gets none of it."""
    if world_size == 1:
        return [env]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(world_size)]


def node_gpus(cfg: RunConfig) -> int:
    """GPUs `train` may place processes on: `placement.gpus`, else the visible CUDA devices (0 on CPU)."""
    if cfg.placement.gpus is not None:
        return cfg.placement.gpus
    if cfg.learner.device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def machine_layout(cfg: RunConfig) -> RunConfig:
    """`cfg` with the layout left unset chosen from this machine's cores and GPUs (layout.py), and its
    "auto" precision from how fast this machine computes bf16 (precision.py)."""
    gpus = node_gpus(cfg)
    return precision.resolve(resolve(cfg, len(os.sched_getaffinity(0)), gpus), gpus)


def dry_run(cfg: RunConfig) -> int:
    """Print the resolved config and the placement; start nothing."""
    cfg = machine_layout(cfg)
    print(cfg.model_dump_json(indent=2))
    gpu_plan = plan(cfg, node_gpus(cfg))
    print(gpu_plan.table() if gpu_plan else
          f"CPU run on {len(os.sched_getaffinity(0))} cores: {cfg.learner.world_size} learner rank(s) of "
          f"{cfg.learner.threads} thread(s) and {cfg.actor.num_actors} actor(s)"
          f"{' (actors pinned, a core per vLLM worker)' if cfg.actor.pin_cores else ''}, actors {cfg.actor.nice} nicer "
          "than the learner")
    return 0


def check_devices(gpu_plan, visible_gpus: int) -> None:
    """A GPU plan must fit the CUDA devices this process sees (`placement.gpus` may claim more)."""
    if gpu_plan is not None and gpu_plan.gpus > visible_gpus:
        raise PlacementError(f"the plan is for {gpu_plan.gpus} GPUs (placement.gpus) but this node shows "
                             f"{visible_gpus} CUDA device(s); set placement.gpus={visible_gpus} and fewer processes")


def reward_function_loads(cfg: RunConfig) -> bool:
    """Whether `actor.verifier.function` (if set) imports here; if not, says why on stderr. Cheap (a
    Python import), and checked before anything starts: every actor would fail with the same error."""
    if cfg.actor.verifier.function is None:
        return True
    try:
        load_reward_function(cfg.actor.verifier.function)
        return True
    except RewardFunctionError as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        return False


def train(cfg: RunConfig, resume_dir: str | None = None) -> int:
    if not reward_function_loads(cfg) or not preflight.report(preflight.check(cfg, resume_dir)):
        return 2  # before the precision probe, the toy policy and any process
    cfg = machine_layout(cfg)
    gpu_plan = plan(cfg, node_gpus(cfg))  # a bad plan fails here, before anything starts
    if gpu_plan is not None and not cfg.placement.rehearse:
        import torch

        check_devices(gpu_plan, torch.cuda.device_count())
    cfg = resolve_toy(cfg)
    run_dir = Path(resume_dir) if resume_dir else new_run_dir(cfg.output_dir)
    cfg.output_dir = str(run_dir)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    print(f"run folder: {run_dir}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every prefix-cache reset at INFO
    children: list[subprocess.Popen] = []
    ranks: list[subprocess.Popen] = []  # the learner's ranks; ranks[0] (the lead) is also children[0]
    stopping, failed_run = False, False  # failed_run: the launcher stopped the run because part of it failed

    def shutdown(*_):
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        (run_dir / "learner.json").unlink(missing_ok=True)  # a resumed run's old address is stale
        cores = sorted(os.sched_getaffinity(0))
        spare, actor_cores = (gpu_core_slices(cores, cfg.actor.num_actors, cfg.actor.pin_cores) if gpu_plan else
                              placement(cores, cfg.actor.num_actors, cfg.actor.pin_cores,
                                        cfg.actor.engine.tensor_parallel_size))
        learner_args = ["learner", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir),
                        *(["--resume"] if resume_dir else [])]
        learner_env = dict(env, OMP_NUM_THREADS=str(cfg.learner.threads))
        if gpu_plan:
            learner_env["CUDA_VISIBLE_DEVICES"] = visible(gpu_plan.learner, env.get("CUDA_VISIBLE_DEVICES"))
            log.info("learner ranks: CUDA_VISIBLE_DEVICES=%s", learner_env["CUDA_VISIBLE_DEVICES"])
        ranks = [_spawn(learner_args, rank_env, spare)
                 for rank_env in learner_rank_envs(learner_env, cfg.learner.world_size)]
        learner = ranks[0]
        children.append(learner)
        # the actors start now, beside the learner: they import vLLM while it loads, then read its address
        actor_args, actor_envs = [], []
        actor_nice = 0 if gpu_plan else cfg.actor.nice
        for i in range(cfg.actor.num_actors):
            args = ["actor", "--learner-file", str(run_dir / "learner.json")]
            if cfg.transport.curve_keys_dir:
                args += ["--keys", cfg.transport.curve_keys_dir]
            if actor_cores[i] is not None:
                args += ["--cpu-cores", ",".join(map(str, actor_cores[i]))]
            actor_args.append(args)
            actor_envs.append(dict(env, OMP_NUM_THREADS=str(cfg.actor.threads),
                                   **({"CUDA_VISIBLE_DEVICES": visible(gpu_plan.actors[i], env.get("CUDA_VISIBLE_DEVICES"))}
                                      if gpu_plan else {})))
            if gpu_plan:
                log.info("actor %d: CUDA_VISIBLE_DEVICES=%s", i + 1, actor_envs[i]["CUDA_VISIBLE_DEVICES"])
            children.append(_spawn(args, actor_envs[i], nice=actor_nice))
        while not (run_dir / "learner.json").exists():
            if learner.poll() is not None or stopping:
                raise RuntimeError(f"learner exited (code {learner.returncode}) before it was ready")
            time.sleep(0.2)
        # a replacement joins a learner that listens already: given the address, it says hello at once
        # and imports vLLM once welcomed (so it counts as joined seconds sooner), like an elastic actor
        address = json.loads((run_dir / "learner.json").read_text())["address"]
        actor_args = [["actor", "--learner", address, *args[3:]] for args in actor_args]
        restarts = [0] * cfg.actor.num_actors
        while not stopping and learner.poll() is None:
            for i, args in enumerate(actor_args):  # a crashed actor is replaced; the learner re-issues its work
                c = children[1 + i]
                if c.poll() is not None and c.returncode != 0 and restarts[i] < cfg.actor.max_restarts:
                    restarts[i] += 1
                    log.warning("actor %d exited with code %s; restarting it (%d/%d)", i + 1, c.returncode,
                                restarts[i], cfg.actor.max_restarts)
                    children[1 + i] = _spawn(args, actor_envs[i], nice=actor_nice)
            gone = [(k, r.returncode) for k, r in enumerate(ranks[1:], 1) if r.poll() is not None and r.returncode != 0]
            if gone:
                log.error("learner rank %d exited with %s; stopping the run (the lead cannot step without it)",
                          gone[0][0], exit_description(gone[0][1]))
                failed_run = True
                break
            failed = [c for c in children[1:] if c.poll() is not None and c.returncode != 0]
            if actor_args and len(failed) == len(actor_args):
                log.error("every actor exited with an error, restarts used up (actor.max_restarts=%d); stopping the "
                          "learner", cfg.actor.max_restarts)
                failed_run = True
                break
            time.sleep(0.5)
    finally:
        # a learner that ended on its own lets the actors finish too; one the launcher stops gets SIGTERM now
        rc = _teardown(children + ranks[1:], wait_first=not (stopping or failed_run))
        for s, h in old.items():
            signal.signal(s, h)
    rc = judge_ranks(rc, [r.returncode for r in ranks[1:]])
    summary = run_dir / "summary.json"
    if summary.exists():
        print_summary(json.loads(summary.read_text()))
    report = run_dir / "report" / "report.md"
    if report.exists() and summary.exists() and report.stat().st_mtime >= summary.stat().st_mtime:  # this run's
        print(f"report: {report}", flush=True)
    if stopping:
        print("interrupted; every child process was stopped", flush=True)
        return 130
    return 1 if failed_run else rc  # the learner stopped by us exits 143: the run failed all the same


def exit_description(code: int | None) -> str:
    """'code 1', or 'signal 9 (SIGKILL)' for a negative Popen return code."""
    if code is not None and code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def judge_ranks(lead_rc: int, follower_rcs: list[int | None]) -> int:
    """The run's code from every learner rank's, whenever each ended: a follower that failed fails a run
    whose lead succeeded (each failed rank logged by number with its code or signal)."""
    rc = lead_rc
    for k, code in enumerate(follower_rcs, 1):
        if code not in (0, None):
            log.error("learner rank %d exited with %s", k, exit_description(code))
            if rc == 0:
                rc = 1
    return rc


def _teardown(children: list[subprocess.Popen], wait_first: bool) -> int:
    """Let children finish on their own (when the learner ended normally), then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + (GRACE_S if wait_first else 0.0)
    while wait_first and time.monotonic() < deadline and any(c.poll() is None for c in children):
        time.sleep(0.2)
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    return children[0].returncode if children else 1


def gain_lines(gain: dict | None) -> list[str]:
    """The held-out gain after - before, with the standard error of that paired difference (the same
    questions scored twice: learner/inbox.py paired_gain) and how many of those errors it is."""
    if not gain:
        return []
    out = []
    for name in ("sampled", "greedy"):
        d, se = gain[name], gain[f"{name}_se"]
        ratio = f" = {d / se:+.1f} SE" if se > 0 else ""
        out.append(f"{'held-out gain, ' + name + ' (paired SE)':38s}{f'{d:+.3f} ± {se:.3f}{ratio}':>20s}"
                   f"  over {gain[f'{name}_questions']} questions")
    return out


def print_summary(s: dict) -> None:
    before, after = s.get("before") or {}, s.get("after") or {}
    rows = [
        ("held-out accuracy (avg@n, sampled)", f"{before.get('accuracy', float('nan')):.3f}", f"{after.get('accuracy', float('nan')):.3f}"),
        ("held-out accuracy (greedy)", f"{before.get('greedy_accuracy', float('nan')):.3f}", f"{after.get('greedy_accuracy', float('nan')):.3f}"),
        # one evaluation's noise (learner/inbox.py standard_error): differences smaller than about twice it are not shown
        ("  its standard error (sampled)", f"{before.get('accuracy_se', float('nan')):.3f}", f"{after.get('accuracy_se', float('nan')):.3f}"),
    ]
    print("\n" + f"{'':38s}{'before':>10s}{'after':>10s}")
    for name, b, a in rows:
        print(f"{name:38s}{b:>10s}{a:>10s}")
    for line in gain_lines(s.get("gain")):
        print(line)
    curve = s.get("held_out_curve") or []
    if len(curve) > 2:  # evaluations during the run too (learner.eval_every)
        points = ", ".join(f"{p['step']}: {p['accuracy']:.3f}" for p in curve)
        print(f"{'held-out sampled, by step':38s}{points}")
    print(f"{'RL steps':38s}{s['steps']:>20d}")
    print(f"{'RL wall time (s)':38s}{s['rl_seconds']:>20.1f}")
    print(f"{'rollouts/s':38s}{s['rollouts_per_s']:>20.1f}")
    print(f"{'generated tokens/s':38s}{s['tokens_per_s']:>20.0f}")
    print(f"{'weight sync, mean broadcast (s)':38s}{s['sync_seconds_mean']:>20.4f}")
    print(f"{'stale groups dropped / skipped steps':38s}{str(s['stale_dropped']) + ' / ' + str(s['skipped_steps']):>20s}")
    print(balance(s.get("learner_idle_median"), s.get("actor_idle_median"), s.get("cores_busy_median")))
    print(f"final model: {s['final_model']}", flush=True)
