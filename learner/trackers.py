"""Experiment trackers: Weights & Biases and TensorBoard, fed from the per-step metrics row.

The row that goes to metrics.jsonl (learner/step_metrics.py) is the single source of truth; the
trackers get the same row, flattened to scalars ("buckets": {"3": 12} -> "buckets/3"), plus the
held-out evaluations ("eval/accuracy", "eval/by_source/<src>/accuracy") and, at the end, the run's
summary. `metrics.trackers` names them (default none); each needs its optional extra
(`pip install 'exgrpo-async[wandb]'`, `[tensorboard]`), checked when the config is validated in
`train` and again before the learner builds anything.

- TensorBoard: event files in RUN_DIR/tensorboard. A resumed run purges the events after its
  checkpoint's step, so the re-run steps are not drawn twice.
- W&B: a run named after the run folder, its id kept in RUN_DIR/wandb-id so `--resume` continues it,
  files under RUN_DIR/wandb; `metrics.wandb_mode="offline"` (or WANDB_MODE) for no network, synced later
  with `wandb sync RUN_DIR/wandb/offline-run-*`.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

from exgrpo_async.config import MetricsConfig
from exgrpo_async.metrics import check_trackers


def flatten(row: dict, prefix: str = "") -> dict[str, float]:
    """The row's finite numbers as {"a/b": value}; nested dicts become paths, the rest is left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class Trackers:
    """The trackers a run's config names; every call is a no-op when it names none."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, config: dict, start_step: int, resumed: bool):
        check_trackers(cfg.trackers)
        self.wandb = self.tb = None
        if "tensorboard" in cfg.trackers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step if resumed else None)
            if not resumed:
                self.tb.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", global_step=0)
        if "wandb" in cfg.trackers:
            import wandb

            id_file = run_dir / "wandb-id"
            if not id_file.exists():
                id_file.write_text(uuid.uuid4().hex[:12])
            self.wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=run_dir.name,
                                    id=id_file.read_text().strip(), resume="allow", dir=str(run_dir), config=config,
                                    mode=cfg.wandb_mode, settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, global_step=step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_step(self, row: dict) -> None:
        """One learner step's metrics row."""
        self.log(row["step"], flatten({k: v for k, v in row.items() if k != "step"}))

    def log_eval(self, step: int, ev: dict) -> None:
        """A held-out evaluation (in-run or final), at the step whose weights it scored."""
        self.log(step, flatten(ev, "eval/"))

    def log_summary(self, summary: dict) -> None:
        """The run's summary.json as the tracker's run summary (W&B) or a text record (TensorBoard)."""
        flat = flatten(summary)
        if self.wandb is not None:
            self.wandb.summary.update(flat)
        if self.tb is not None:
            self.tb.add_text("summary", "```\n" + json.dumps(summary, indent=2, default=str) + "\n```",
                             global_step=summary.get("steps") or 0)

    def close(self, crashed: bool = False) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if crashed else 0)
        self.wandb = self.tb = None
