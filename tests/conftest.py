"""Shared fixtures: tiny randomly initialised Qwen2 policies built locally (no model hub).

Selection: tests that take more than about 20 s (every `exgrpo-async train` run, every vLLM engine,
real multi-process runs) are marked `slow`; `-m "not slow"` is the quick selection (the unit tests
and the quick integration tests, under 5 minutes on 2 cores). To keep that true, the session ends
with a list of the tests not marked slow that took longer than FAST_LIMIT_S (setup, call and
teardown together); with EXGRPO_CHECK_FAST=1 such a test fails the session. It also ends with how
busy the machine's CPUs were during its slowest tests: a slow test at low CPU is waiting (fixed waits,
timeouts, processes starting one after another), one at full CPU is computing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FAST_LIMIT_S = 30.0
_unmarked_seconds: dict[str, float] = {}  # test id -> seconds, for tests not marked slow
_cpu_use: dict[str, tuple[float, float]] = {}  # test id -> (seconds, share of the machine's CPU busy meanwhile)
CPU_REPORT_TESTS = 25
# The order files run in. First the longest that do not need the toy policy, while it builds in the
# background on a machine without it cached (tests/integration/conftest.py); then those that need it,
# longest first (from a suite run's durations); then the rest, short files that even out the two
# workers' ends (ops/test runs each file on one of two pytest-xdist workers).
RUN_ORDER = [f"tests/{name}.py" for name in (
    "integration/test_weight_sync_vllm", "unit/test_memory_model", "unit/test_toy_shipped", "unit/test_lead_wait",
    "integration/test_hostile_learner", "integration/test_learner_ranks", "integration/test_stream_engine",
    "integration/test_joins", "unit/test_gpu_check",  # about 200 s without the toy policy
    "integration/test_rehearsal", "integration/test_full_run", "integration/test_faults", "integration/test_soak",
    "integration/test_bench_runs",
    "integration/test_prometheus", "integration/test_eval", "integration/test_resume", "integration/test_fuzz",
    "integration/test_multinode")]


def build_tiny_policy(out: Path, tied: bool, seed: int = 0) -> Path:
    from exgrpo_async.toy.task import build_model, build_tokenizer

    build_tokenizer(out)
    model = build_model(seed)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() + 0.01)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("tiny_tied"), tied=True)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("tiny_untied"), tied=False)


@pytest.fixture(autouse=True, scope="session")
def _quiet_single_thread():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    torch.set_num_threads(1)
    yield


# vLLM's CPU platform writes these into the environment of any process that builds an engine (a test
# worker does, for the in-process engines), and every process started after inherits them: with
# TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1 the GPU check's compiled step corrupted its heap (CI's failures of
# tests/unit/test_gpu_check.py; learner/maths/compiled.py `fixed_cpu_threads`), LD_PRELOAD loads libraries into it.
VLLM_ENV = ("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "LD_PRELOAD", "OMP_NUM_THREADS",
            "NUMEXPR_MAX_THREADS", "LOCAL_WORLD_SIZE")
_SESSION_ENV = {k: os.environ.get(k) for k in VLLM_ENV}


@pytest.fixture(autouse=True)
def _environment_as_the_session_found_it():
    """Each test (after its fixtures, an engine fixture's included) runs with VLLM_ENV as the session began."""
    for key, value in _SESSION_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    yield


def pytest_collection_modifyitems(config, items):
    """Files in RUN_ORDER's order, the others after them in collection order; tests marked `gpu` need
    CUDA: skip them (visibly) on machines without it."""
    rank = {path: i for i, path in enumerate(RUN_ORDER)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _cpu_jiffies() -> tuple[int, int] | None:
    """(all, idle + iowait) jiffies over every core since boot; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return None
    return sum(fields), fields[3] + fields[4]


_cpu_start: dict[str, tuple[tuple[int, int] | None, float]] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _cpu_start[item.nodeid] = (_cpu_jiffies(), time.monotonic())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where the suite waits: how busy the machine's CPUs were during each test (set-up, call and
    teardown), carried on the teardown's report so that it reaches the controller under xdist."""
    outcome = yield
    if call.when != "teardown" or item.nodeid not in _cpu_start:
        return
    start, t0 = _cpu_start.pop(item.nodeid)
    end = _cpu_jiffies()
    if start and end and end[0] > start[0]:
        busy = 1.0 - (end[1] - start[1]) / (end[0] - start[0])
        outcome.get_result().user_properties.append(("cpu_use", (time.monotonic() - t0, busy)))


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_use":
            _cpu_use[report.nodeid] = tuple(value)
    if "slow" not in report.keywords:
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    slowest = sorted(_cpu_use.items(), key=lambda kv: -kv[1][0])[:CPU_REPORT_TESTS]
    if slowest:
        cores = os.cpu_count() or 1
        terminalreporter.section(f"CPU use of the slowest {len(slowest)} tests ({cores} cores; idle core-s: waiting)")
        for nodeid, (seconds, busy) in slowest:
            terminalreporter.line(f"{seconds:7.1f} s  {100 * busy:4.0f}% busy  {seconds * cores * (1 - busy):6.1f} idle core-s  "
                                  f"{nodeid}")
    too_long = {k: v for k, v in _unmarked_seconds.items() if v > FAST_LIMIT_S}
    if not too_long:
        return
    strict = os.environ.get("EXGRPO_CHECK_FAST") == "1"
    terminalreporter.section(f"tests not marked slow that took over {FAST_LIMIT_S:.0f} s", red=strict,
                             yellow=not strict)
    for nodeid, seconds in sorted(too_long.items(), key=lambda kv: -kv[1]):
        terminalreporter.line(f"{seconds:7.1f} s  {nodeid}")
    terminalreporter.line("mark them @pytest.mark.slow (the quick selection, -m 'not slow', must stay under 5 minutes)"
                          + ("; EXGRPO_CHECK_FAST=1: this fails the session" if strict
                             else "; EXGRPO_CHECK_FAST=1 makes this an error"))


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("EXGRPO_CHECK_FAST") == "1" and exitstatus == 0 and any(
            v > FAST_LIMIT_S for v in _unmarked_seconds.values()):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
