"""Entry points of the actor role: an actor process (pin to its cores on CPU, find the learner, run the
loop), and `exgrpo-async eval` (`run_eval`: the same engines and verifier, scoring a model on held-out files).

The learner's address is given (`--learner tcp://HOST:PORT`: the actor joins at once and starts vLLM
once welcomed) or read from the file the learner writes once it listens (`--learner-file
RUN_DIR/learner.json`): `train` starts its actors beside the learner that way, and they import vLLM
(7-9 s of a CPU core) while they wait, so the import overlaps the learner's start-up instead of
following it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from exgrpo_async.config import RunConfig
from exgrpo_async.logs import end_process
from exgrpo_async.startup import without_gc

log = logging.getLogger("exgrpo_async.actor")

ADDRESS_FILE_PATIENCE_S = 1800.0  # a learner loading a large policy takes minutes before it listens
ADDRESS_FILE_LOG_S = 60.0


def main(learner_address: str | None, cpu_cores: list[int] | None, keys_dir: str | None = None,
         hello_retry_s: float | None = None, learner_file: str | None = None,
         patience_s: float = ADDRESS_FILE_PATIENCE_S) -> NoReturn:
    """Serve the learner until it says stop, then end the process (exit 0) without finalizing torch and
    vLLM, everything closed by then; a failure propagates (its traceback, exit 1)."""
    if cpu_cores:
        os.sched_setaffinity(0, set(cpu_cores))  # before torch starts its threads
    with without_gc():  # torch's import and the loop's (exgrpo_async/startup.py); vLLM's is preload_vllm's
        import torch

        from actors.loop import run
        from actors.session import HELLO_ATTEMPT_S

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from actors.engine import no_compiling_on_cpu

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        no_compiling_on_cpu()
    address = learner_address
    if address is None:  # the learner may still be starting: import vLLM meanwhile (see the docstring)
        from actors.engine import preload_vllm

        preload_vllm()
        address = wait_for_address(Path(learner_file), patience_s)
    run(address, on_cpu=on_cpu, keys_dir=keys_dir,
        hello_retry_s=HELLO_ATTEMPT_S if hello_retry_s is None else hello_retry_s)
    end_process(0)


def run_eval(cfg: RunConfig, model: str, files: list[str], samples: int, temperature: float, max_tokens: int,
             limit: int | None, actors: int, seed: int, out: Path | None, save_completions: bool) -> int:
    """`exgrpo-async eval`: score `model` on `files` with `actors` engines, write the report (to `out`, or
    beside the model) and print its table; 2 with the reason for data or a model it cannot evaluate."""
    import torch

    from actors.engine import no_compiling_on_cpu
    from actors.evaluate import EvalError, default_out, evaluate, format_table, write_report
    from exgrpo_async.data import DataError

    if not torch.cuda.is_available():  # this process only evaluates (its engines may run here: --actors 1)
        no_compiling_on_cpu()

    try:
        report = evaluate(cfg, model, files, samples, temperature, max_tokens, limit, actors, seed)
    except (DataError, EvalError) as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        return 2
    out = out or default_out(model)
    write_report(report, out, save_completions)
    print(format_table(report))
    print(f"report: {out}")
    return 0


def wait_for_address(path: Path, patience_s: float) -> str:
    """The address in the learner's `learner.json` (written whole, by rename, when the learner listens),
    waiting for the file up to `patience_s`; a file without an address is an error."""
    deadline = time.monotonic() + patience_s
    next_log = time.monotonic() + ADDRESS_FILE_LOG_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no learner address in {path} after {patience_s:.0f}s")
        if time.monotonic() > next_log:
            log.info("waiting for the learner's address in %s", path)
            next_log += ADDRESS_FILE_LOG_S
        time.sleep(0.1)
    address = json.loads(path.read_text()).get("address")
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ValueError(f"{path} holds no learner address (tcp://HOST:PORT): {address!r}")
    return address
