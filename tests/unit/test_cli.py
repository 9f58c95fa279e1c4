"""The command line's small commands: --version, config show / config diff, and the log level that
keeps vLLM's start-up noise out of a user's terminal."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib

from exgrpo_async.config_io import config_diff, config_toml, load_config
from exgrpo_async.launcher.cli import main
from exgrpo_async.logs import DropVllmNoise, setup_logging

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "exgrpo_async.launcher.cli"]


def test_version_is_the_installed_package_version():
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"exgrpo-async {version('exgrpo-async')}"


@pytest.mark.parametrize("config", [None, *sorted(str(p) for p in (REPO / "configs").glob("*.toml"))])
def test_config_show_reads_back_to_the_same_config(config, tmp_path):
    cfg = load_config(config, ["learner.lr=1e-4", "actor.num_actors=3"])
    text = config_toml(cfg)
    tomllib.loads(text)  # valid TOML
    path = tmp_path / "shown.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    unset = next(line for line in text.splitlines() if line.startswith("# unset"))
    assert "learner.threads" in unset and "actor.num_actors" not in unset


def test_config_show_prints_the_overrides(capsys):
    assert main(["config", "show", "learner.lr=0.00025", "exgrpo.enabled=true"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["learner"]["lr"] == 0.00025 and shown["exgrpo"]["enabled"] is True
    assert shown["rollout"]["samples_per_question"] == 8  # defaults filled in


def test_config_diff_lists_every_changed_key(tmp_path, capsys):
    a = load_config(None, ["learner.max_steps=3"])
    b = load_config(None, ["learner.max_steps=5", "exgrpo.enabled=true", "metrics.trackers=[\"tensorboard\"]"])
    assert config_diff(a, b) == ["exgrpo.enabled: false -> true", "learner.max_steps: 3 -> 5",
                                 'metrics.trackers: [] -> ["tensorboard"]']
    assert config_diff(a, a) == []
    for name, cfg in (("run-a", a), ("run-b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(cfg.model_dump_json(indent=2))
    assert main(["config", "diff", str(tmp_path / "run-a"), str(tmp_path / "run-b")]) == 0
    assert capsys.readouterr().out.splitlines() == config_diff(a, b)
    assert main(["config", "diff", str(tmp_path / "run-a"), str(tmp_path / "run-a")]) == 0
    assert "the same" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # not a run folder: a clear error, exit 2
        main(["config", "diff", str(tmp_path), str(tmp_path / "run-a")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


def _records(level_name: str) -> str:
    stream = io.StringIO()
    setup_logging("actor", "actor-1", level_name=level_name)
    handler = logging.getLogger().handlers[0]
    handler.setStream(stream)
    vllm = logging.getLogger("vllm.v1.worker.cpu_worker")
    vllm.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    vllm.warning("KV cache is full")  # a warning that tells something stays
    logging.getLogger("py.warnings").warning("/x/site-packages/vllm/triton_utils/dispatcher.py:139: FutureWarning: "
                                             "`torch.distributed.reduce_op` is deprecated")
    logging.getLogger("exgrpo_async.learner").debug("a debug line")
    return stream.getvalue()


def test_vllm_start_up_noise_is_dropped_unless_debug(monkeypatch):
    monkeypatch.delenv("EXGRPO_LOG_LEVEL", raising=False)
    # vLLM imported in this test process earlier (another test) installs its own handler unless our
    # set-up ran first, as it does in every process of ours: undo that here
    vllm_root = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_root, "propagate", True)
    monkeypatch.setattr(vllm_root, "handlers", [])
    try:
        quiet = _records("info")
        assert "KV cache is full" in quiet
        assert "set_num_threads" not in quiet and "reduce_op" not in quiet and "a debug line" not in quiet
        loud = _records("debug")
        assert "set_num_threads" in loud and "reduce_op" in loud and "a debug line" in loud
    finally:
        setup_logging("test", level_name="info")


def test_the_noise_filter_leaves_our_own_records_alone():
    record = logging.LogRecord("exgrpo_async.actor", logging.WARNING, __file__, 1, "Triton says hi", None, None)
    assert DropVllmNoise().filter(record)


def test_a_bad_log_level_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("EXGRPO_LOG_LEVEL", "loud")
    assert main(["report", "/nonexistent"]) == 2
    assert "log level 'loud'" in capsys.readouterr().err


def test_train_refuses_a_tracker_whose_library_is_missing(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert main(["train", "--dry-run", 'metrics.trackers=["wandb"]']) == 2
    assert "exgrpo-async[wandb]" in capsys.readouterr().err



@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_hello_retry_is_refused_before_the_actor_starts(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["actor", "--learner", "tcp://127.0.0.1:1", "--hello-retry-s", value])
    assert e.value.code == 2
    assert "--hello-retry-s" in capsys.readouterr().err
