"""Shared fixtures of the integration tests that run `exgrpo-async` for real.

`small` is the common set of overrides: a toy policy warm-started once per test session (in a temporary
cache, so a test run never depends on ~/.cache) and a small batch.
"""

from __future__ import annotations

import pytest

# long enough for a few correct answers (ExGRPO needs partly solved groups), short for CI: about 120 s
# on an idle 2-core machine (~3.5 steps/s), and the same policy however loaded the machine is
SFT_STEPS = 420


@pytest.fixture(scope="session")
def small(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("toycache")
    return [f"toy.cache_dir={cache}", f"toy.sft_steps={SFT_STEPS}", "learner.questions_per_step=8",
            "rollout.samples_per_question=4", "rollout.questions_per_request=4", "rollout.eval_samples=1"]
