"""`model.dtype="auto"` and `learner.mixed_precision="auto"`: one decision, from the CPU's flags and a probe."""

import pytest

from exgrpo_async import precision
from exgrpo_async.config_io import load_config

ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def test_native_bf16_from_the_cpu_flags():
    assert precision.native_cpu_bf16(precision.cpu_flags(ZEN4), "x86_64")
    assert not precision.native_cpu_bf16(precision.cpu_flags(AVX2_ONLY), "x86_64")
    assert precision.native_cpu_bf16(precision.cpu_flags(ARM), "aarch64")
    assert not precision.native_cpu_bf16(precision.cpu_flags("processor\t: 0\n"), "x86_64")


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_resolves_both_settings_together_and_keeps_explicit_ones(bf16):
    cfg = load_config(None)
    assert (cfg.model.dtype, cfg.learner.mixed_precision) == ("auto", "auto")  # the demo's default
    got = precision.apply(cfg, bf16)
    assert (got.model.dtype, got.learner.mixed_precision) == (("bfloat16", "bf16") if bf16 else ("float32", "none"))
    assert cfg.model.dtype == "auto"  # a copy, the input unchanged
    pinned = load_config(None, ["model.dtype=float32", "learner.mixed_precision=none"])
    assert precision.apply(pinned, True) is pinned
    half = precision.apply(load_config(None, ["learner.mixed_precision=none"]), True)
    assert (half.model.dtype, half.learner.mixed_precision) == ("bfloat16", "none")


def test_no_native_bf16_means_fp32_without_a_probe(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda flags, machine: False)
    monkeypatch.setattr(precision, "probe_bf16_ratio", lambda: pytest.fail("probed a CPU without native bf16"))
    assert not precision.bf16_is_fast(0)


def test_the_probe_decides_on_a_native_cpu(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda flags, machine: True)
    for ratio, want in ((0.6, True), (precision.PROBE_RATIO, True), (0.95, False), (1.2, False)):
        monkeypatch.setattr(precision, "probe_bf16_ratio", lambda r=ratio: r)
        assert precision.bf16_is_fast(0) is want



@pytest.mark.parametrize("fast", [True, False])
def test_a_standalone_learner_resolves_auto_before_it_builds_anything(monkeypatch, fast):
    from learner.main import _resolve_precision
    from learner.ranks import Ranks

    monkeypatch.setattr(precision, "bf16_is_fast", lambda gpus: fast)
    got = _resolve_precision(load_config(None, ["learner.device=cpu"]), Ranks())
    assert (got.model.dtype, got.learner.mixed_precision) == (("bfloat16", "bf16") if fast else ("float32", "none"))


def test_the_learner_refuses_an_unresolved_auto(tmp_path):
    from learner.policy import Policy
    from learner.ranks import Ranks

    with pytest.raises(ValueError, match="unresolved"):
        Policy(load_config(None), Ranks(), __import__("torch").device("cpu"))
