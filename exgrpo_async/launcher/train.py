"""`exgrpo-async train`: start one learner and N actors on this machine, watch them, tear them down.

The learner and every actor are separate OS processes started exactly as a user would start them on
several hosts (`exgrpo-async learner` / `exgrpo-async actor --learner ADDR [--keys DIR]`); this launcher only adds
local conveniences: the toy policy, the run folder, one CPU core per actor, and clean shutdown.
`train` reads as its steps: check (a custom reward function imports, data files, model folder, output
folder and fixed ports; launcher/preflight.py), plan (the machine's layout, precision and GPU plan), open
the run folder, spawn, supervise, tear down, summarise.
Shutdown: Ctrl-C or SIGTERM reaches every child (SIGTERM, then SIGKILL after a grace period); children
also get SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so no process is orphaned.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from exgrpo_async import precision
from exgrpo_async.config import RunConfig
from exgrpo_async.launcher import preflight
from exgrpo_async.launcher.placement import PlacementError, Plan, plan, visible
from exgrpo_async.launcher.processes import (
    exit_description,
    gpu_core_slices,
    judge_ranks,
    learner_rank_envs,
    placement,
    spawn,
    teardown,
)
from exgrpo_async.launcher.summary import print_summary
from exgrpo_async.layout import resolve
from exgrpo_async.runs import new_run_dir, resolve_toy

log = logging.getLogger("exgrpo_async.launcher.train")


def train(cfg: RunConfig, resume_dir: str | None = None) -> int:
    if not preflight.reward_function_loads(cfg) or not preflight.report(preflight.check(cfg, resume_dir)):
        return 2  # before the precision probe, the toy policy and any process
    cfg, gpu_plan = plan_run(cfg)
    run = LocalRun(open_run_dir(cfg, resume_dir))
    failed = False
    with stop_on_signals() as stop:
        try:
            spawn_run(run, cfg, gpu_plan, resume=resume_dir is not None)
            address = wait_for_learner(run, stop)
            failed = address is None and not stop.requested  # the learner ended before it listened
            if address is not None:
                failed = supervise(run, cfg, address, stop)
        finally:
            # a learner that ended on its own lets the actors finish too; one the launcher stops gets SIGTERM now
            rc = teardown(run.children, wait_first=not (stop.requested or failed))
    rc = judge_ranks(rc, [r.returncode for r in run.ranks[1:]])
    summarise(run.run_dir)
    if stop.requested:
        print("interrupted; every child process was stopped", flush=True)
        return 130
    return 1 if failed else rc  # the learner stopped by us exits 143: the run failed all the same


# ------------------------------------------------------------------------------------------ plan
# A GPU driver's device files (NVIDIA's, NVIDIA's under WSL, ROCm's): without any, torch counts no CUDA device
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def node_gpus(cfg: RunConfig) -> int:
    """GPUs `train` may place processes on: `placement.gpus`, else the visible CUDA devices (0 on CPU).
    Torch is asked only where a GPU driver is present: importing it took 1.2-2.4 s of a core on an idle Xeon,
    several at an AVX2-only CPU's pace beside other work, before any process of the run could start."""
    if cfg.placement.gpus is not None:
        return cfg.placement.gpus
    if cfg.learner.device == "cpu" or not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        return 0
    import torch

    return torch.cuda.device_count()


def machine_layout(cfg: RunConfig) -> RunConfig:
    """`cfg` with the layout left unset chosen from this machine's cores and GPUs (layout.py), and its
    "auto" precision from how fast this machine computes bf16 (precision.py)."""
    gpus = node_gpus(cfg)
    return precision.resolve(resolve(cfg, len(os.sched_getaffinity(0)), gpus), gpus)


def check_devices(gpu_plan: Plan | None, visible_gpus: int) -> None:
    """A GPU plan must fit the CUDA devices this process sees (`placement.gpus` may claim more)."""
    if gpu_plan is not None and gpu_plan.gpus > visible_gpus:
        raise PlacementError(f"the plan is for {gpu_plan.gpus} GPUs (placement.gpus) but this node shows "
                             f"{visible_gpus} CUDA device(s); set placement.gpus={visible_gpus} and fewer processes")


def check_cpu_node(cfg: RunConfig, gpus: int, cores: int) -> None:
    """What a node without GPUs cannot run (each failed later in a child: the learner's traceback, or every
    actor's, restarts used up)."""
    if gpus:
        return
    if cfg.learner.device == "cuda":
        raise PlacementError("learner.device='cuda' but this node has no GPU; use 'cpu' or 'auto'")
    if cfg.weight_sync.backend == "nccl":
        raise PlacementError("weight_sync.backend='nccl' needs GPUs and this node has none; use 'gloo' or 'auto'")
    tp = cfg.actor.engine.tensor_parallel_size
    if cfg.actor.num_actors != 0 and tp > cores:
        raise PlacementError(f"actor.engine.tensor_parallel_size={tp} on CPU needs a core per worker; this machine "
                             f"gives {cores}")


def plan_run(cfg: RunConfig) -> tuple[RunConfig, Plan | None]:
    """The config resolved for this machine (layout, precision, the toy policy) and its GPU plan; a bad plan
    fails here, before anything starts."""
    check_cpu_node(cfg, node_gpus(cfg), len(os.sched_getaffinity(0)))
    cfg = machine_layout(cfg)
    gpu_plan = plan(cfg, node_gpus(cfg))
    if gpu_plan is not None and not cfg.placement.rehearse:
        import torch

        check_devices(gpu_plan, torch.cuda.device_count())
    return resolve_toy(cfg), gpu_plan


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


def open_run_dir(cfg: RunConfig, resume_dir: str | None) -> Path:
    """The run folder (new, or the one resumed), with the resolved config written into it."""
    run_dir = Path(resume_dir) if resume_dir else new_run_dir(cfg.output_dir)
    cfg.output_dir = str(run_dir)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    (run_dir / "learner.json").unlink(missing_ok=True)  # a resumed run's old address is stale
    print(f"run folder: {run_dir}", flush=True)
    return run_dir


# ------------------------------------------------------------------------------------------ spawn
@dataclass
class LocalRun:
    """The processes `train` started on this machine, and how to start an actor again."""

    run_dir: Path
    ranks: list[subprocess.Popen] = field(default_factory=list)  # the learner's; ranks[0] is the lead
    actors: list[subprocess.Popen] = field(default_factory=list)
    actor_args: list[list[str]] = field(default_factory=list)
    actor_envs: list[dict] = field(default_factory=list)
    actor_nice: int = 0

    @property
    def children(self) -> list[subprocess.Popen]:
        """Every process, the lead first (teardown returns its code)."""
        return self.ranks[:1] + self.actors + self.ranks[1:]


def spawn_run(run: LocalRun, cfg: RunConfig, gpu_plan: Plan | None, resume: bool) -> None:
    """Start the learner's ranks, then the actors beside them: they import vLLM while the learner loads,
    then read its address from RUN_DIR/learner.json."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every prefix-cache reset at INFO
    cores = sorted(os.sched_getaffinity(0))
    spare, actor_cores = (gpu_core_slices(cores, cfg.actor.num_actors, cfg.actor.pin_cores) if gpu_plan else
                          placement(cores, cfg.actor.num_actors, cfg.actor.pin_cores,
                                    cfg.actor.engine.tensor_parallel_size))
    learner_args = ["learner", "--config", str(run.run_dir / "config.json"), "--run-dir", str(run.run_dir),
                    *(["--resume"] if resume else [])]
    learner_env = dict(env, OMP_NUM_THREADS=str(cfg.learner.threads))
    if gpu_plan:
        learner_env["CUDA_VISIBLE_DEVICES"] = visible(gpu_plan.learner, env.get("CUDA_VISIBLE_DEVICES"))
        log.info("learner ranks: CUDA_VISIBLE_DEVICES=%s", learner_env["CUDA_VISIBLE_DEVICES"])
    for rank_env in learner_rank_envs(learner_env, cfg.learner.world_size):
        run.ranks.append(spawn(learner_args, rank_env, spare))
    run.actor_nice = 0 if gpu_plan else cfg.actor.nice
    for i in range(cfg.actor.num_actors):
        args = ["actor", "--learner-file", str(run.run_dir / "learner.json")]
        if cfg.transport.curve_keys_dir:
            args += ["--keys", cfg.transport.curve_keys_dir]
        if actor_cores[i] is not None:
            args += ["--cpu-cores", ",".join(map(str, actor_cores[i]))]
        actor_env = dict(env, OMP_NUM_THREADS=str(cfg.actor.threads))
        if gpu_plan:
            actor_env["CUDA_VISIBLE_DEVICES"] = visible(gpu_plan.actors[i], env.get("CUDA_VISIBLE_DEVICES"))
            log.info("actor %d: CUDA_VISIBLE_DEVICES=%s", i + 1, actor_env["CUDA_VISIBLE_DEVICES"])
        run.actor_args.append(args)
        run.actor_envs.append(actor_env)
        run.actors.append(spawn(args, actor_env, nice=run.actor_nice))


# ------------------------------------------------------------------------------------------ supervise
class StopRequest:
    """Set by Ctrl-C or SIGTERM while the run is watched."""

    requested = False


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM set the returned flag instead of ending the launcher, until the block ends."""
    stop = StopRequest()

    def handler(*_) -> None:
        stop.requested = True

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def wait_for_learner(run: LocalRun, stop: StopRequest) -> str | None:
    """The learner's address once it listens; None if the run was stopped first or the learner exited
    before it listened (logged in one line: the learner's own log says why)."""
    lead, address_file = run.ranks[0], run.run_dir / "learner.json"
    while not address_file.exists():
        if lead.poll() is not None:
            log.error("the learner exited (%s) before it was ready; its log above says why",
                      exit_description(lead.returncode))
            return None
        if stop.requested:
            return None
        time.sleep(0.2)
    return json.loads(address_file.read_text())["address"]


def supervise(run: LocalRun, cfg: RunConfig, address: str, stop: StopRequest) -> bool:
    """Watch the run until the learner ends or a stop is requested: restart a crashed actor (up to
    `actor.max_restarts` each), stop the run if a learner rank or every actor fails for good. Whether the
    launcher stopped the run because part of it failed."""
    # a replacement joins a learner that listens already: given the address, it says hello at once
    # and imports vLLM once welcomed (so it counts as joined seconds sooner), like an elastic actor
    again = [["actor", "--learner", address, *args[3:]] for args in run.actor_args]
    restarts = [0] * len(run.actors)
    while not stop.requested and run.ranks[0].poll() is None:
        for i, actor in enumerate(run.actors):  # a crashed actor is replaced; the learner re-issues its work
            if actor.poll() is not None and actor.returncode != 0 and restarts[i] < cfg.actor.max_restarts:
                restarts[i] += 1
                log.warning("actor %d exited with code %s; restarting it (%d/%d)", i + 1, actor.returncode,
                            restarts[i], cfg.actor.max_restarts)
                run.actors[i] = spawn(again[i], run.actor_envs[i], nice=run.actor_nice)
        gone = [(k, r.returncode) for k, r in enumerate(run.ranks[1:], 1) if r.poll() is not None and r.returncode != 0]
        if gone:
            log.error("learner rank %d exited with %s; stopping the run (the lead cannot step without it)",
                      gone[0][0], exit_description(gone[0][1]))
            return True
        if run.actors and all(a.poll() is not None and a.returncode != 0 for a in run.actors):
            log.error("every actor exited with an error, restarts used up (actor.max_restarts=%d); stopping the "
                      "learner", cfg.actor.max_restarts)
            return True
        time.sleep(0.5)
    return False


# ------------------------------------------------------------------------------------------ summarise
def summarise(run_dir: Path) -> None:
    """Print the run's summary and where its report is, if this run wrote them."""
    summary = run_dir / "summary.json"
    if summary.exists():
        print_summary(json.loads(summary.read_text()))
    report = run_dir / "report" / "report.md"
    if report.exists() and summary.exists() and report.stat().st_mtime >= summary.stat().st_mtime:  # this run's
        print(f"report: {report}", flush=True)
