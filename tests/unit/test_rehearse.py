"""exgrpo_async/launcher/rehearse.py: what a rehearsal keeps from a GPU config, what it replaces, and its data.
(The rehearsals themselves run in tests/integration/test_rehearsal.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from exgrpo_async.config_io import load_config
from exgrpo_async.data import load_pool, render_prompt, set_chat_template
from exgrpo_async.launcher.rehearse import (
    EVAL_PER_SOURCE,
    EVAL_SOURCES,
    TOY_CHAT_TEMPLATE,
    TRAIN_QUESTIONS,
    rehearsal,
    write_data,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SEVEN_B = str(CONFIGS / "qwen2.5-math-7b-8gpu.toml")


@pytest.fixture
def toy_assets(monkeypatch, tiny_tied):
    """The toy policy's cache stands in for a warm start: rehearsal() only needs its paths."""
    monkeypatch.setattr("exgrpo_async.toy.task.ensure_toy_assets", lambda *a, **k: {"model": tiny_tied})


def test_the_topology_and_recipe_are_kept_and_gpu_settings_replaced(toy_assets, tiny_tied, tmp_path, monkeypatch):
    node = load_config(SEVEN_B)
    cfg, gpu_plan, changes = rehearsal(SEVEN_B, [f"output_dir={tmp_path / 'runs'}"])
    assert (gpu_plan.gpus, gpu_plan.learner, gpu_plan.actors) == (8, [0, 1, 2, 3], [[4, 5], [6, 7]])
    for get in (lambda c: c.learner.world_size, lambda c: c.actor.engine.tensor_parallel_size,
                lambda c: c.learner.mixed_precision, lambda c: c.learner.gradient_checkpointing,
                lambda c: c.model.dtype, lambda c: c.data.system_prompt, lambda c: c.data.use_chat_template,
                lambda c: c.learner.minibatches_per_step, lambda c: c.rollout.samples_per_question,
                lambda c: c.actor.engine.in_process, lambda c: c.actor.verifier.workers, lambda c: c.exgrpo.enabled,
                lambda c: c.learner.best_exclude_sources, lambda c: c.placement.gpus):
        assert get(cfg) == get(node)
    assert (cfg.learner.device, cfg.weight_sync.backend, cfg.placement.rehearse) == ("cpu", "gloo", True)
    assert cfg.actor.num_actors == 1 and cfg.model.path == str(tiny_tied)
    assert cfg.output_dir == str(tmp_path / "runs")  # the user's, the data in its data/
    assert Path(cfg.data.train_files[0]).parent == tmp_path / "runs" / "data"
    monkeypatch.chdir(tmp_path)  # the config's output_dir is relative
    default, _, _ = rehearsal(SEVEN_B, [])
    assert default.output_dir == load_config(SEVEN_B).output_dir + "-rehearsal"
    replaced = {line.split(" = ")[0] for line in changes}
    assert {"learner.device", "weight_sync.backend", "actor.num_actors", "model.path"} <= replaced
    assert all(": " in line for line in changes)  # each with its reason


def test_the_users_overrides_beat_the_rehearsals(toy_assets, tmp_path):
    cfg, _, changes = rehearsal(SEVEN_B, [f"output_dir={tmp_path}", "learner.max_steps=6", "actor.num_actors=2"])
    assert (cfg.learner.max_steps, cfg.actor.num_actors) == (6, 2)
    assert not [line for line in changes if line.startswith(("learner.max_steps", "actor.num_actors"))]


def test_a_cpu_config_is_refused(toy_assets, tmp_path):
    with pytest.raises(ValueError, match="rehearses a GPU config"):
        rehearsal(str(CONFIGS / "cpu-demo.toml"), [f"output_dir={tmp_path}"])


def test_the_data_is_the_configs_format_with_one_bad_row(tiny_tied, tmp_path):
    node = load_config(SEVEN_B)
    train, valid = write_data(node, tmp_path)
    pool = load_pool([train], skip_bad_rows=True)
    assert len(pool.questions) == TRAIN_QUESTIONS and len(pool.skipped) == 1
    q = pool.questions[0]
    assert [m["role"] for m in q.messages] == ["system", "user"] and q.messages[0]["content"] == node.data.system_prompt
    held_out = load_pool([valid]).questions
    assert sorted({h.source for h in held_out}) == sorted(EVAL_SOURCES.values())
    assert len(held_out) == EVAL_PER_SOURCE * len(EVAL_SOURCES)
    assert not {h.messages[-1]["content"] for h in held_out} & {t.messages[-1]["content"] for t in pool.questions}
    # through the config's chat-template path, the toy policy reads "<bos>" + the question
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tied)
    set_chat_template(tok, TOY_CHAT_TEMPLATE)
    assert render_prompt(q, "{problem}", node.data.system_prompt, True, tok) == "<bos>" + q.messages[-1]["content"]
