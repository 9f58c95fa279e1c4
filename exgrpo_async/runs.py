"""A run's folder, and the toy model a config may name: what the launcher and a learner started on its own
(`exgrpo-async learner`, torchrun) both resolve before they start."""

from __future__ import annotations

import time
from pathlib import Path

from exgrpo_async.config import RunConfig


def resolve_toy(cfg: RunConfig) -> RunConfig:
    """Replace model.path="toy" by the cached warm-started policy and its train/test files (the test file
    only where data.eval_file was left unset: an explicit `data.eval_file=none` turns evaluation off)."""
    if cfg.model.path != "toy":
        return cfg
    from exgrpo_async.toy.task import PROMPT_TEMPLATE, ensure_toy_assets

    paths = ensure_toy_assets(Path(cfg.toy.cache_dir), cfg.toy.seed, cfg.toy.sft_steps, threads=cfg.toy.sft_threads)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(paths["model"])
    cfg.data.train_files = cfg.data.train_files or [str(paths["train"])]
    if cfg.data.eval_file is None and "eval_file" not in cfg.data.model_fields_set:
        cfg.data.eval_file = str(paths["test"])
    cfg.data.prompt_template = PROMPT_TEMPLATE
    return cfg


def new_run_dir(output_dir: str) -> Path:
    """A new folder `run-YYYYmmdd-HHMMSS[-n]` under `output_dir`."""
    base = Path(output_dir)
    run_dir = base / time.strftime("run-%Y%m%d-%H%M%S")
    n = 1
    while run_dir.exists():
        run_dir = base / f"{time.strftime('run-%Y%m%d-%H%M%S')}-{n}"
        n += 1
    run_dir.mkdir(parents=True)
    return run_dir
