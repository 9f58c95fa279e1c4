"""Shared fixtures of the integration tests that run `exgrpo-async` for real.

`small` is the common set of overrides: a toy policy warm-started once (cached under
EXGRPO_TEST_TOY_CACHE, default ~/.cache/exgrpo_async/tests, in a folder keyed by the recipe and by
toy.py's source, so a suite on a reused machine skips the two-minute SFT and never reuses a stale one),
a small batch, and the precision pinned (fp32 actors and learner: "auto" asks a timing probe, whose
answer can change between two runs compared for equality; the bf16 learner is run explicitly where a
test says so).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# long enough for a few correct answers (ExGRPO needs partly solved groups), short for CI: about 120 s
# on an idle 2-core machine (~3.5 steps/s), and the same policy however loaded the machine is
SFT_STEPS = 420
TOY_CACHE = Path(os.environ.get("EXGRPO_TEST_TOY_CACHE", "~/.cache/exgrpo_async/tests")).expanduser()
PINNED_PRECISION = ["model.dtype=float32", "learner.mixed_precision=none"]


@pytest.fixture(scope="session")
def small() -> list[str]:
    return [f"toy.cache_dir={TOY_CACHE}", f"toy.sft_steps={SFT_STEPS}", "learner.questions_per_step=8",
            "rollout.samples_per_question=4", "rollout.questions_per_request=4", "rollout.eval_samples=1",
            *PINNED_PRECISION]
