"""Entry point of the learner process: resolve the config, make the run folder, run the loop."""

from __future__ import annotations

from pathlib import Path

from exgrpo_async.config import RunConfig
from exgrpo_async.launch import new_run_dir, resolve_toy


def main(cfg: RunConfig, run_dir: str | None, resume: bool = False) -> int:
    cfg = resolve_toy(cfg)
    out = Path(run_dir) if run_dir else new_run_dir(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    from learner.train import run

    run(cfg, out, resume=resume)
    return 0
