"""Experiment trackers (learner/trackers.py) read back from what they wrote: TensorBoard's event files
through its EventAccumulator, W&B's offline run file through its own protobuf records."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from exgrpo_async.config import MetricsConfig
from exgrpo_async.config_io import load_config
from exgrpo_async.metrics import check_trackers
from learner.trackers import Trackers, flatten


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every event file under RUN_DIR/tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run_dir: Path) -> list:
    """The records of RUN_DIR's offline W&B run file (its log format: 32 KiB blocks of records, each a
    7-byte header (crc, length, type) and a chunk; types 1 = whole, 2-4 = first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def wandb_history(run_dir: Path) -> dict[int, dict]:
    rows = {}
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            rows[row["_step"]] = row
    return rows


ROWS = [{"step": s, "reward_mean": 0.25 * s, "buckets": {"1": 3, "4": s}, "loss": float("nan"), "note": "x",
         "staleness_hist": {"0": 30, "1": 2}, "is_weight_max": None} for s in (1, 2, 3)]


def test_flatten_keeps_finite_numbers_and_paths():
    flat = flatten(ROWS[1])
    assert flat == {"step": 2.0, "reward_mean": 0.5, "buckets/1": 3.0, "buckets/4": 2.0, "staleness_hist/0": 30.0,
                    "staleness_hist/1": 2.0}


def test_both_trackers_record_steps_evals_and_summary(tmp_path):
    cfg = MetricsConfig(trackers=["wandb", "tensorboard"], wandb_mode="offline")
    t = Trackers(cfg, tmp_path, {"learner": {"lr": 5e-5}}, start_step=1, resumed=False)
    t.log_eval(0, {"accuracy": 0.3, "by_source": {"toy": {"accuracy": 0.3}}, "versions": [0]})
    for row in ROWS:
        t.log_step(row)
    t.log_eval(3, {"accuracy": 0.5, "by_source": {"toy": {"accuracy": 0.5}}})
    t.log_summary({"steps": 3, "rl_seconds": 12.5, "after": {"accuracy": 0.5}})
    t.close()

    tb = tensorboard_scalars(tmp_path)
    assert tb["reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert tb["buckets/4"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert tb["eval/accuracy"] == [(0, pytest.approx(0.3)), (3, 0.5)]
    assert "loss" not in tb and "note" not in tb  # NaN and text are left out

    history = wandb_history(tmp_path)
    assert [history[s]["reward_mean"] for s in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert history[0]["eval/by_source/toy/accuracy"] == 0.3 and history[3]["eval/accuracy"] == 0.5
    assert history[3]["buckets/4"] == 3  # the evaluation joins its step's row
    run = next(r.run for r in wandb_records(tmp_path) if r.WhichOneof("record_type") == "run")
    assert run.display_name == tmp_path.name and run.project == "exgrpo-async"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["learner"] == {"lr": 5e-5}
    summary = {}
    for r in wandb_records(tmp_path):
        if r.WhichOneof("record_type") == "summary":
            summary.update({item.key: json.loads(item.value_json) for item in r.summary.update})
    assert summary["rl_seconds"] == 12.5 and summary["after/accuracy"] == 0.5


def test_a_resumed_run_continues_its_wandb_run_and_redraws_lost_steps_once(tmp_path):
    cfg = MetricsConfig(trackers=["wandb", "tensorboard"], wandb_mode="offline")
    t = Trackers(cfg, tmp_path, {}, start_step=1, resumed=False)
    for row in ROWS:
        t.log_step(row)
    t.close(crashed=True)
    run_id = (tmp_path / "wandb-id").read_text()
    # the checkpoint was at step 2: step 3 is trained again, with another result
    t = Trackers(cfg, tmp_path, {}, start_step=3, resumed=True)
    t.log_step({"step": 3, "reward_mean": 0.9})
    t.close()
    assert (tmp_path / "wandb-id").read_text() == run_id
    assert tensorboard_scalars(tmp_path)["reward_mean"] == [(1, 0.25), (2, 0.5), (3, pytest.approx(0.9))]


def test_no_trackers_write_nothing(tmp_path):
    t = Trackers(MetricsConfig(), tmp_path, {}, start_step=1, resumed=False)
    t.log_step(ROWS[0])
    t.close()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_tracker_library_is_named_with_its_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ValueError, match=r"pip install 'exgrpo-async\[wandb\]'"):
        check_trackers(["tensorboard", "wandb"])
    check_trackers(["tensorboard"])


def test_tracker_names_are_checked_by_the_config():
    with pytest.raises(ValueError, match="metrics.trackers"):
        load_config(None, ['metrics.trackers=["mlflow"]'])
    with pytest.raises(ValueError, match="named twice"):
        load_config(None, ['metrics.trackers=["wandb", "wandb"]'])
