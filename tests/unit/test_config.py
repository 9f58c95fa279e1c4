"""The config schema: shipped files parse, overrides apply, bad input is rejected with a clear message."""

from pathlib import Path

import pytest

from exgrpo_async.config import RunConfig
from exgrpo_async.config_io import config_from_json, load_config

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def test_there_are_configs_to_check():
    names = {p.name for p in CONFIGS}
    assert {"cpu-demo.toml", "qwen2.5-math-1.5b-8gpu.toml", "qwen2.5-math-7b-8gpu.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert cfg.rollout.samples_per_question >= 2


def test_cpu_demo_file_equals_embedded_default():
    assert load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu-demo.toml") == load_config(None)


def test_paper_settings_in_7b_config():
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-math-7b-8gpu.toml")
    L = cfg.learner
    assert (L.questions_per_step, cfg.rollout.samples_per_question, L.lr, L.weight_decay) == (128, 8, 1e-6, 0.01)
    assert (L.minibatches_per_step, cfg.rollout.max_new_tokens, L.skip_grad_norm, L.max_steps) == (2, 8192, 500.0, 700)
    assert cfg.actor.verifier.require_think and L.betas == (0.9, 0.999)


@pytest.mark.parametrize("name,shape", [("qwen2.5-math-1.5b-8gpu.toml", "QWEN25_15B"),
                                        ("qwen2.5-math-7b-8gpu.toml", "QWEN25_7B")])
def test_8gpu_configs_are_the_paper_recipe_and_fit_8x80gb(name, shape):
    """ExGRPO on, LUFFY's system prompt (the very text of the authors' held-out rows), a template that
    opens <think> for the 1.5B backbone, best weights chosen without Minerva; the planner accepts the
    placement on 8 GPUs and the memory model puts each learner rank, the lead with its publish buffers, under 90% of an 80 GB H100."""
    from exgrpo_async.data import load_pool
    from exgrpo_async.launcher.placement import plan
    from learner.maths import memory_model

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    assert cfg.exgrpo.enabled and cfg.exgrpo.rho == 0.5 and cfg.exgrpo.selection == "lowest_entropy"
    luffy = load_pool([str(DATA / "exgrpo_luffy" / "valid.parquet")]).questions[0].messages[0]["content"]
    assert cfg.data.system_prompt == luffy and cfg.data.use_chat_template and cfg.actor.verifier.require_think
    assert cfg.data.chat_template == ("think" if "1.5b" in name else None)  # the 7B model ships the think template
    assert cfg.learner.best_exclude_sources == ["minerva"] and cfg.learner.eval_every == 10
    assert cfg.rollout.eval_temperature == 0.6 and cfg.rollout.eval_samples == 1
    p = plan(cfg, 8)
    assert len(p.learner) == cfg.learner.world_size and all(len(g) == cfg.actor.engine.tensor_parallel_size
                                                             for g in p.actors)
    s, tokens, world = getattr(memory_model, shape), cfg.learner.max_tokens_per_micro_batch, cfg.learner.world_size
    per_rank = memory_model.rank_bytes(s, tokens, world)
    # the lead also keeps the packed weights it sends: one set on a GPU (weight_sync.publish_sets unset)
    assert cfg.weight_sync.publish_sets is None and cfg.model.dtype == "bfloat16"
    lead = memory_model.lead_bytes(s, tokens, world, publish_sets=1, sync_dtype_bytes=2)
    budget = 0.9 * memory_model.H100_80GB_BYTES
    assert per_rank < lead < budget, f"{per_rank / 1e9:.1f} GB per learner rank, {lead / 1e9:.1f} GB on the lead"
    if world > 1:  # two sets (the publisher before issue 33) would not fit beside a 7B rank's state
        assert memory_model.lead_bytes(s, tokens, world, publish_sets=2) > budget


def test_dotted_overrides_with_typed_values():
    cfg = load_config(None, ["learner.lr=1e-4", "rollout.samples_per_question=4", "transport.host=0.0.0.0",
                             "transport.curve_keys_dir=/etc/exgrpo/keys",
                             "learner.betas=[0.9, 0.95]", "data.use_chat_template=true"])
    assert cfg.learner.lr == 1e-4 and cfg.rollout.samples_per_question == 4
    assert cfg.transport.host == "0.0.0.0" and cfg.learner.betas == (0.9, 0.95) and cfg.data.use_chat_template


@pytest.mark.parametrize("override, needle", [
    ("learner.lrr=1", "learner.lrr"),                       # unknown key, named
    ("bogus.key=1", "bogus"),                               # unknown section
    ("learner.lr=-1", "learner.lr"),                        # out of range
    ("rollout.samples_per_question=1", "samples_per_question"),
    ("weight_sync.backend=mpi", "weight_sync.backend"),
    ("learner.minibatches_per_step=7", "divisible"),         # cross-field rule
    ("model.path=/some/model", "train_files"),              # a real model needs data
    ("rollout.max_new_tokens=256", "leaves no room for a prompt"),  # the whole context for the completion
])
def test_bad_values_rejected_with_a_clear_message(override, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_in_file_is_rejected(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[learner]\nlearning_rate = 1e-5\n")
    with pytest.raises(ValueError, match="learner.learning_rate"):
        load_config(p)
    p.write_text("[learner\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="section.key=value"):
        load_config(None, ["learner.lr"])


def test_resolved_json_roundtrip(tmp_path):
    cfg = load_config(None, ["learner.max_steps=7"])
    assert config_from_json(cfg.model_dump_json()) == cfg
    p = tmp_path / "config.json"
    p.write_text(cfg.model_dump_json())
    assert load_config(p) == cfg


def test_every_field_has_a_docstring():
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, RunConfig.__mro__[1]):
                walk(ann, f"{prefix}{name}.")
    walk(RunConfig)


def test_config_reference_doc_is_current():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    rc = subprocess.run([sys.executable, str(root / "ops" / "gen_config_doc.py"), "--check"]).returncode
    assert rc == 0, "docs/config.md is stale: run ops/gen_config_doc.py"


def test_none_words_set_optional_fields(tmp_path):
    cfg = load_config(None, ["exgrpo.shaping_beta=none", "exgrpo.max_trajectories=null", "metrics.port=None"])
    assert cfg.exgrpo.shaping_beta is None and cfg.exgrpo.max_trajectories is None and cfg.metrics.port is None
    p = tmp_path / "c.toml"
    p.write_text('[exgrpo]\nshaping_beta = "none"\nmu = 0.25\n')
    assert load_config(p).exgrpo.shaping_beta is None and load_config(p).exgrpo.mu == 0.25
    with pytest.raises(ValueError, match="learner.lr"):
        load_config(None, ["learner.lr=none"])  # not optional: still an error


@pytest.mark.parametrize("overrides,expected", [([], "TEST"), (["data.eval_file=none"], None),
                                                (["data.eval_file=held.jsonl"], "held.jsonl")])
def test_the_toy_test_set_is_the_default_eval_file_but_none_turns_it_off(tmp_path, monkeypatch, overrides, expected):
    """With model.path="toy", an unset data.eval_file means the toy test set; an explicit none means no
    held-out evaluation (it used to be replaced by the toy test set too), and survives config.json."""
    import exgrpo_async.toy.task as toy
    from exgrpo_async.runs import resolve_toy

    paths = {"model": tmp_path / "m", "train": tmp_path / "train.jsonl", "test": tmp_path / "test.jsonl"}
    monkeypatch.setattr(toy, "ensure_toy_assets", lambda *a, **k: paths)  # the warm start itself: not needed here
    cfg = resolve_toy(load_config(None, ["model.path=toy", *overrides]))
    want = str(paths["test"]) if expected == "TEST" else expected
    assert cfg.data.eval_file == want and cfg.model.path == str(paths["model"])
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    assert resolve_toy(load_config(tmp_path / "config.json")).data.eval_file == want
