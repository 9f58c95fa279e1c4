"""ops/bench/gpu/gpu_gaps.py: the device's idle time charged to what launched the next kernel (a synthetic
trace, on CPU), and, on a GPU, the learner's step synchronising with its host only where it must."""

import random

import pytest
import torch

from exgrpo_async.config import RunConfig
from exgrpo_async.toy.task import build_model
from learner.maths import attention
from learner.maths.batch import Seq
from learner.maths.update import StepSettings, update_policy
from tests.bench import load_bench

gpu_gaps = load_bench("gpu/gpu_gaps")


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_idle_time_is_charged_to_the_launch_after_the_gap():
    trace = {"traceEvents": [
        _x("user_annotation", "exgrpo.forward", 0, 27),
        _x("cpu_op", "aten::mm", 10, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, corr=1),
        _x("kernel", "gemm", 15, 10, tid=7, corr=1),
        _x("user_annotation", "exgrpo.optimizer", 28, 112),
        _x("cpu_op", "aten::item", 29, 102),
        _x("cuda_runtime", "cudaStreamSynchronize", 30, 100),
        _x("cpu_op", "aten::foo", 132, 7),
        _x("cpu_op", "aten::add", 133, 5),  # the innermost op around the launch
        _x("cuda_driver", "cuLaunchKernel", 135, 2, corr=2),
        _x("kernel", "add", 140, 10, tid=7, corr=2),
        _x("kernel", "add2", 145, 10, tid=8),  # overlaps: busy until 155, no gap
    ]}
    res = gpu_gaps.idle_gaps(trace)
    assert res["window_ms"] == 0.14 and res["busy_ms"] == 0.025 and res["idle_ms"] == 0.115
    assert res["gaps"] == 1
    assert res["idle_ms_by_launch"] == {"exgrpo.optimizer / aten::add": 0.115}
    assert res["host_waits_ms"] == {"exgrpo.optimizer / aten::item (cudaStreamSynchronize)": 0.1}


def test_no_device_events_give_no_figures():
    assert gpu_gaps.idle_gaps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}) == {}


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_step_synchronises_only_to_check_the_grad_norm_and_read_its_results():
    """Packed rows, two mini-batches (pre-update log-probs recomputed for the second), the staleness
    correction and pi_past collected: the host waits once per optimizer update (the grad norm decides a
    skip) and once at the end (the step's statistics), nowhere in the micro-batch loop."""
    dev = torch.device("cuda")
    rng = random.Random(0)
    seqs = [Seq([1] + [rng.randrange(4, 90) for _ in range(6)], [rng.randrange(4, 90) for _ in range(rng.randrange(3, 20))],
                torch.full((1,), -1.0), rng.choice([-0.5, 0.5]), 1, g, False, j == 0) for g in range(4) for j in range(4)]
    for s in seqs:
        s.logprobs = torch.full((len(s.completion),), -1.5)
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = 24
    L = cfg.learner
    L.max_tokens_per_micro_batch, L.minibatches_per_step, L.mixed_precision = 64, 2, "bf16"
    L.off_policy_correction, L.entropy_coef = "token_truncate", 1e-3
    model = build_model(0).to(dev)
    attention.use(model, "varlen")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = lambda: update_policy(model, opt, seqs, 4, cfg, StepSettings(clip=0.2), dev, 0, 0)  # noqa: E731
    step()  # warm-up: first-call set-up may synchronise
    box = {}
    found = gpu_gaps.sync_sites(lambda: box.setdefault("res", step()), top=50)
    assert box["res"].pi_past and box["res"].updates == 2
    funcs = {site.split()[-1] for site in found["sites"] if site.startswith("learner/")}  # the code under test
    assert "optimizer_step" in funcs and funcs <= {"optimizer_step", "finish_result", "read_phases"}, found
