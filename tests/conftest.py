"""Shared fixtures: tiny randomly initialised Qwen2 policies built locally (no model hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def build_tiny_policy(out: Path, tied: bool, seed: int = 0) -> Path:
    from exgrpo_async.toy import build_model, build_tokenizer

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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skip them (visibly) on machines without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
