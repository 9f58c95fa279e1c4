"""Weight fingerprints (exgrpo_async/fingerprint.py, learner/fingerprints.py): exact, layout-free sums
that change when any weight does, and the learner's check that counts, logs and taints a mismatch."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from exgrpo_async.fingerprint import bitsum, expected, mismatched, probe_columns
from exgrpo_async.weight_sync import WeightPublisher
from exgrpo_async.wire import WireError
from learner.fingerprints import FingerprintCheck


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitsum_ignores_layout_and_sees_every_element(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g).to(dtype), torch.randn(3, 5, generator=g).to(dtype)
    fused = torch.cat([a, b])
    assert bitsum(fused) == bitsum(a) + bitsum(b)  # q/k/v fused into one tensor: the same sum
    assert bitsum(fused.t().contiguous()) == bitsum(fused) == bitsum(fused[torch.randperm(9, generator=g)])
    assert bitsum(fused, chunk=7) == bitsum(fused)  # widened a chunk at a time: the same sum
    for i in range(fused.numel()):  # the smallest change of any one element changes the sum
        changed = fused.clone().reshape(-1)
        changed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[i] += 1  # the next value up
        assert bitsum(changed) != bitsum(fused), i


def test_probed_linears_match_an_engine_that_fuses_them():
    """What a fused q/k/v layer returns for the one-hot probes (F.linear, as an engine computes it) sums
    to the learner's expectation from the separate tensors; the tied LM head is the embedding's."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 8, generator=g) for n in (8, 4, 4))
    qb, kb, vb = (torch.randn(n, generator=g) for n in (8, 4, 4))
    embed = torch.randn(32, 8, generator=g)
    named = {"m.l.attn.q_proj.weight": q, "m.l.attn.k_proj.weight": k, "m.l.attn.v_proj.weight": v,
             "m.l.attn.q_proj.bias": qb, "m.l.attn.k_proj.bias": kb, "m.l.attn.v_proj.bias": vb,
             "model.embed_tokens.weight": embed}
    want = expected(named)
    cols = probe_columns(8)
    x = torch.zeros(len(cols), 8)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    fused = torch.nn.functional.linear(x, torch.cat([q, k, v]), torch.cat([qb, kb, vb]))
    assert want["m.l.attn"] == (bitsum(fused) + bitsum(torch.cat([qb, kb, vb]))) % 2**64
    assert want["lm_head"] == bitsum(torch.nn.functional.linear(x, embed))  # tied: no lm_head published
    assert want["model"] == bitsum(embed)
    stale = dict(named, **{"m.l.attn.v_proj.weight": v.clone().index_put_((torch.tensor([0]), torch.tensor([cols[1]])),
                                                                          torch.tensor(9.0))})
    assert mismatched(expected(stale), want) == ["m.l.attn"]


def test_a_bias_vllm_widened_to_fp32_sums_as_published_and_a_changed_one_still_shows():
    """On a CPU with AVX-512-BF16 or AMX, vLLM's small-GEMM kernel keeps a bf16 layer's bias in fp32
    (found here: every bf16 demo's attention blocks mismatched and every group was rejected). The engine
    side sums it back in its weight's dtype, exactly; a bias whose values changed still differs."""
    from actors.fingerprint import as_published

    g = torch.Generator().manual_seed(2)
    bias = torch.randn(16, generator=g).to(torch.bfloat16)
    dtypes = {"m.l.attn.qkv_proj": torch.bfloat16}
    widened = as_published("m.l.attn.qkv_proj.bias", bias.float(), dtypes)
    assert widened.dtype == torch.bfloat16 and bitsum(widened) == bitsum(bias) != bitsum(bias.float())
    changed = bias.float().clone()
    changed[3] += 0.5
    assert bitsum(as_published("m.l.attn.qkv_proj.bias", changed, dtypes)) != bitsum(bias)
    norm = torch.randn(16, generator=g)  # not a linear layer's bias: summed as stored
    assert as_published("m.l.norm.weight", norm, dtypes) is norm
    assert as_published("m.l.mlp.down_proj.bias", norm, dtypes) is norm  # no such linear: as stored


def test_the_publisher_fingerprints_what_it_packed_and_keeps_the_last_few():
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), 1, 5.0)
    named = [("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8)), ("model.norm.weight", torch.randn(8))]
    for version in range(20):
        pub.publish(version, named)
        v, meta, flat = pub.snapshot()
        assert pub.fingerprint(v, meta, flat) == expected(dict(named))
    assert pub.expected_fingerprint(19) is not None and pub.expected_fingerprint(3) is None


def test_a_mismatch_is_counted_and_taints_that_actor_and_version():
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), 1, 5.0)
    named = [("model.norm.weight", torch.randn(8))]
    pub.publish(4, named)
    want = pub.fingerprint(*pub.snapshot())
    counters: Counter = Counter()
    check = FingerprintCheck(pub, counters)
    assert check.check("actor-1", 4, want) and counters["fingerprints_checked"] == 1
    assert not check.check("actor-2", 4, {**want, "model": (want["model"] + 1) % 2**64})
    assert counters["weight_fingerprint_mismatches"] == 1
    held = time.monotonic()  # work actor-2 held while it ran the bad load
    assert check.tainted("actor-2", 4, held) and not check.tainted("actor-1", 4, held)
    assert not check.tainted("actor-2", 5, held)
    # sent version 4 again (the learner had not moved on), actor-2 now reports it right: work handed out
    # from then on is clean again, what it held before stays rejected
    assert check.check("actor-2", 4, want) and counters["weight_fingerprint_mismatches"] == 1
    after = time.monotonic()
    assert check.tainted("actor-2", 4, held) and not check.tainted("actor-2", 4, after)
    assert not check.check("actor-2", 4, {**want, "model": (want["model"] + 1) % 2**64})  # bad again
    assert check.tainted("actor-2", 4, time.monotonic())
    assert check.check("actor-1", 3, {"model": 1}) and counters["fingerprints_unchecked"] == 1  # not kept: not judged
    for bad in ([1, 2], {"model": -1}, {"model": 2**64}, {"model": True}, {1: 2}):
        with pytest.raises(WireError):
            check.check("actor-1", 4, bad)


def test_a_tensor_parallel_engines_shares_add_up_to_the_whole():
    """actors/fingerprint.py `combine`: each worker's block sums over its slice add (mod 2**64) to the
    whole model's, and one worker without a fingerprint leaves the engine without one."""
    from actors.fingerprint import combine

    g = torch.Generator().manual_seed(0)
    embed, norm = torch.randn(10, 4, generator=g), torch.randn(4, generator=g)
    whole = expected({"model.embed_tokens.weight": embed, "model.norm.weight": norm})
    # a vocabulary split in two rows slices; the norm, whole on both workers, counted by worker 0 only
    shares = [{"model": (bitsum(embed[:5]) + bitsum(norm)) & ((1 << 64) - 1)}, {"model": bitsum(embed[5:])}]
    assert combine(shares) == {k: v for k, v in whole.items() if k == "model"}
    assert combine([shares[0], shares[0]]) != combine(shares)
    assert combine([shares[0], None]) is None
