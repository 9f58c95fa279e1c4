"""Shared fixtures of the integration tests that run `exgrpo-async` for real.

`small` is the common set of overrides: the demo's warm-started toy policy (installed from the copy the
package ships, exgrpo_async/toy/shipped.py, under EXGRPO_TEST_TOY_CACHE, default
~/.cache/exgrpo_async/tests, in a folder keyed by the recipe; were the recipe changed without
rebuilding the shipped copy, the first session builds it: minutes), the held-out set's first 200
questions (the set the tests were written against; the demo's has 1,000), a small batch, and the
precision pinned (fp32 actors and learner: "auto" asks a timing probe, whose
answer can change between two runs compared for equality; the bf16 learner is run explicitly where a
test says so).

When a selected test needs the toy policy (the `toy` fixture, which `small` uses) and it is not cached
yet, its build starts in a background process as soon as collection ends, so the tests that do not
need it (ordered first, tests/conftest.py) run meanwhile; `toy` waits for the build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the demo's warm start, which the package ships (a second's install, no SFT); a few correct answers
# at least are needed (ExGRPO needs partly solved groups)
SFT_STEPS = 600
HELD_OUT_QUESTIONS = 200
TOY_CACHE = Path(os.environ.get("EXGRPO_TEST_TOY_CACHE", "~/.cache/exgrpo_async/tests")).expanduser()
PINNED_PRECISION = ["model.dtype=float32", "learner.mixed_precision=none"]


TOY = [f"toy.cache_dir={TOY_CACHE}", f"toy.sft_steps={SFT_STEPS}"]
TOY_BUILD_TIMEOUT_S = 1200
_build: dict[str, object] = {}  # the background build started at collection's end: "proc", "log"


def pytest_collection_finish(session) -> None:
    """Start the toy policy's build in the background if a selected test needs it: `train`'s own call,
    which returns at once when the policy is cached (under xdist each worker starts one; they take turns
    on the build's lock, the second finds it done)."""
    if session.config.option.collectonly or not any("toy" in getattr(i, "fixturenames", ()) for i in session.items):
        return
    TOY_CACHE.mkdir(parents=True, exist_ok=True)
    log = TOY_CACHE / f"build-{os.getpid()}.log"
    code = ("import sys; from exgrpo_async.config_io import load_config; from exgrpo_async.runs import resolve_toy; "
            "resolve_toy(load_config(None, sys.argv[1:]))")  # the same call as `train`'s
    # the build's 2 OpenMP threads share the cores with the tests: spinning at each barrier while the
    # other thread waits for a core made it 1.8x slower beside two busy processes (120 SFT steps: 102 s,
    # 57 s passive; the same loss either way), `git show 716cf5e:ops/bench/omp_wait.py`,
    # docs/history/benchmarks-notebook.md's ninth pass
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    with open(log, "w") as out:
        _build.update(proc=subprocess.Popen([sys.executable, "-c", code, *TOY], stdout=out, stderr=subprocess.STDOUT,
                                            cwd=Path(__file__).resolve().parents[2], env=env), log=log)


def pytest_sessionfinish(session) -> None:
    """A build still running when the session ends (stopped early, or no test got to wait for it) is
    killed, not left behind; without its `done` marker the next session builds again."""
    proc = _build.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)


@pytest.fixture(scope="session")
def toy() -> Path:
    """The toy policy's folder, built once (waiting for the background build if one is running)."""
    proc = _build.get("proc")
    if proc is not None:
        try:
            rc = proc.wait(timeout=TOY_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert rc == 0, f"the toy policy's build failed (exit {rc}):\n" + _build["log"].read_text()[-3000:]
        _build["log"].unlink(missing_ok=True)
    from exgrpo_async.config_io import load_config
    from exgrpo_async.runs import resolve_toy

    return Path(resolve_toy(load_config(None, TOY)).model.path)


@pytest.fixture(scope="session")
def held_out(toy, tmp_path_factory) -> Path:
    """The toy held-out set's first HELD_OUT_QUESTIONS questions (its first pass over the five kinds)."""
    from exgrpo_async.config_io import load_config
    from exgrpo_async.runs import resolve_toy

    full = Path(resolve_toy(load_config(None, TOY)).data.eval_file)
    out = tmp_path_factory.mktemp("held-out") / "held-out.jsonl"
    out.write_text("".join(full.read_text().splitlines(keepends=True)[:HELD_OUT_QUESTIONS]))
    return out


@pytest.fixture(scope="session")
def small(toy, held_out) -> list[str]:
    return [*TOY, "learner.questions_per_step=8", "rollout.samples_per_question=4", "rollout.questions_per_request=4",
            "rollout.eval_samples=1", f"data.eval_file={held_out}", *PINNED_PRECISION]


@pytest.fixture
def as_in_an_actor_process(monkeypatch):
    """For a test that runs vLLM engines in its own process: what an actor's process sets on CPU
    (actors/engine.py `no_compiling_on_cpu`: vLLM's compiled helpers run eagerly, here and in the
    engine's child processes), undone after the test, so a later test of this worker still compiles."""
    import torch._dynamo

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    with torch._dynamo.config.patch(disable=True):
        yield
