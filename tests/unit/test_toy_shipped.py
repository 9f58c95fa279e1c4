"""The shipped warm-started toy policy (exgrpo_async/toy/shipped.py): it is the demo's recipe, it installs
instead of the SFT, a damaged copy is refused, and the mode that builds it gives the same bits whatever
the CPU's vector width and the thread count."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exgrpo_async import precision
from exgrpo_async.config import ToyConfig
from exgrpo_async.toy import shipped as toy_shipped
from exgrpo_async.toy import task as toy

REBUILD = "the recipe changed: rebuild the shipped policy with `ops/toy-policy build` and commit it"


def test_the_shipped_policy_is_the_demos_recipe():
    m = toy_shipped.manifest()
    assert m is not None, "exgrpo_async/toy/policy/shipped.json is missing"
    assert (m["seed"], m["sft_steps"]) == (ToyConfig().seed, ToyConfig().sft_steps)
    assert m["key"] == toy.recipe_key(m["seed"], m["sft_steps"]), REBUILD
    assert toy_shipped.sha256(toy_shipped.SHIPPED / "model.safetensors") == m["sha256"]
    lo, hi = toy.WARM_START_BAND["greedy"]
    assert lo <= m["sft"]["greedy_accuracy"] <= hi


def test_the_key_follows_the_recipe_source(monkeypatch):
    key = toy.recipe_key(0, 600)
    assert toy.recipe_key(0, 601) != key and toy.recipe_key(1, 600) != key
    monkeypatch.setattr(toy, "RECIPE", toy.RECIPE[:-1])  # as if sft's source had changed
    assert toy.recipe_key(0, 600) != key


@pytest.mark.timeout(120)
def test_the_demos_recipe_installs_the_shipped_weights_without_an_sft(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    monkeypatch.setattr(toy, "sft", lambda *a, **k: pytest.fail("trained although the policy is shipped"))
    paths = toy.ensure_toy_assets(tmp_path, ToyConfig().seed, ToyConfig().sft_steps)
    model = AutoModelForCausalLM.from_pretrained(str(paths["model"]))
    shipped = load_file(str(toy_shipped.SHIPPED / "model.safetensors"))
    state = model.state_dict()
    assert shipped and all(state[k].equal(v) for k, v in shipped.items())
    tok = PreTrainedTokenizerFast.from_pretrained(str(paths["model"]))
    assert tok.decode(tok("12+34=")["input_ids"]) == "12+34="
    sft = json.loads((paths["model"].parent / "sft.json").read_text())
    assert sft["shipped"] is True and sft["sft_steps"] == ToyConfig().sft_steps
    held_out = [json.loads(line) for line in paths["test"].read_text().splitlines()]
    assert len(held_out) == toy.HELD_OUT_PER_KIND * len(toy.TEST_KINDS)
    assert held_out[:200] == toy.make_test_set(0, per_kind=toy.FIRST_PASS)  # the 200 it held before it grew
    train = {json.loads(line)["problem"] for line in paths["train"].read_text().splitlines()}
    assert not train & {r["problem"] for r in held_out}


def test_a_damaged_copy_is_refused(tmp_path):
    folder = tmp_path / "shipped"
    shutil.copytree(toy_shipped.SHIPPED, folder)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(toy_shipped.ShippedPolicyError, match="damaged install"):
        toy_shipped.install(tmp_path / "policy", tmp_path / "sft.json", toy.build_tokenizer, folder)
    assert not (tmp_path / "sft.json").exists()


SFT_HASH = """
import hashlib, sys, torch
from exgrpo_async.toy import task as toy
torch.set_num_threads(int(sys.argv[1]))
tok_dir = sys.argv[2]
toy.build_tokenizer(tok_dir)
from transformers import PreTrainedTokenizerFast
model = toy.build_model(0)
toy.sft(model, PreTrainedTokenizerFast.from_pretrained(tok_dir), 4, set(), 0, log_every=0)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(v.numpy().tobytes())
print(h.hexdigest())
"""
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _sft_hash(tmp_path: Path, threads: int, env: dict) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (*AVX2_CAPS, *toy_shipped.REPRODUCIBLE_ENV)}
    out = subprocess.run([sys.executable, "-c", SFT_HASH, str(threads), str(tmp_path / f"tok-{len(os.listdir(tmp_path))}")],
                         env=dict(clean, **env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # four processes, each importing torch and transformers: 24 s here
@pytest.mark.timeout(300)
def test_the_build_mode_gives_the_same_bits_on_any_vector_width_and_thread_count(tmp_path):
    """Four SFT steps at the real shapes: in the build mode, one thread at full width and two threads
    capped at AVX2 (as an AVX2-only CPU runs) give the same weights. Where this CPU has AVX-512, the
    same two runs without the build mode differ, which shows the comparison can fail."""
    rep = toy_shipped.REPRODUCIBLE_ENV
    assert _sft_hash(tmp_path, 1, rep) == _sft_hash(tmp_path, 2, {**AVX2_CAPS, **rep})
    if "avx512f" in Path("/proc/cpuinfo").read_text() and not precision.avx2_only():  # as an AVX2-only CPU: skipped
        assert _sft_hash(tmp_path, 1, {}) != _sft_hash(tmp_path, 2, AVX2_CAPS)
