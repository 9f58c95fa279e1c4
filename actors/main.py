"""Entry point of an actor process: pin to its cores (CPU), then join the learner and run the loop."""

from __future__ import annotations

import os


def main(learner_address: str, cpu_cores: list[int] | None, keys_dir: str | None = None,
         hello_retry_s: float | None = None) -> int:
    if cpu_cores:
        os.sched_setaffinity(0, set(cpu_cores))  # before torch starts its threads
    import torch

    from actors.loop import HELLO_ATTEMPT_S, run

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run(learner_address, on_cpu=on_cpu, keys_dir=keys_dir,
        hello_retry_s=HELLO_ATTEMPT_S if hello_retry_s is None else hello_retry_s)
    return 0
