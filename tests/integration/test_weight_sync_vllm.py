"""Gloo weight sync into a real vLLM CPU engine (in-process engine core, real worker extension).

After a broadcast of perturbed weights, vLLM's greedy continuation must equal the learner model's, and
its sampled-token log-probs must match the learner's log_softmax: with tied embeddings (the CPU lm_head
pitfall), without them, and for prompts longer than the 128-token prefix-cache block (stale-KV pitfall);
through the pre-packed swap (actors/cpu_reload.py, the default) and vLLM's layerwise reload. The
broadcast uses 1 MB buckets, so the swap stages layers across several buckets. A tensor-parallel engine
(TP 2: two vLLM worker processes, one CPU core each) joins with both workers and must match too, its
fingerprint the sum of its workers' shares.
"""

from __future__ import annotations

import threading

import pytest
import torch

from actors.engine import VLLMEngine
from exgrpo_async.config import EngineConfig, ModelConfig
from exgrpo_async.fingerprint import mismatched
from exgrpo_async.weight_sync import WeightPublisher

pytestmark = pytest.mark.usefixtures("as_in_an_actor_process")  # vLLM engines in this process

SHORT = ["<bos>12+34=", "<bos>7*8=", "<bos>99-45=", "<bos>3+4*5="]
LONG = ["<bos>" + "1234567890+" * 14 + "5=", "<bos>" + "9876543210-" * 13 + "7="]  # > 128 tokens


def joined(engine: VLLMEngine) -> WeightPublisher:
    """A learner-side publisher (1 MB buckets) whose group the engine's worker has joined."""
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=60)
    t = threading.Thread(target=pub.open_group, args=("a", 1 + engine.tp))
    t.start()
    engine.init_weight_sync("127.0.0.1", pub.port, "ws/a/", 1 + engine.tp, "gloo", 60)
    t.join()
    return pub


def sync(engine: VLLMEngine, pub: WeightPublisher, model, version: int, named: list | None = None,
         corrupt: bool = False) -> list[str]:
    """Publish, broadcast and load `version`; returns the blocks whose fingerprints differ between the
    engine (after the load) and the publisher (exgrpo_async/fingerprint.py)."""
    pub.publish(version, named or list(model.named_parameters()))
    _, meta, flat = pub.snapshot()
    t = threading.Thread(target=pub.send, args=("a", flat))
    t.start()
    engine.load_weights(meta, version, fingerprint=True, corrupt=corrupt)
    t.join(timeout=60)
    assert not t.is_alive()
    assert engine.fingerprint is not None
    return mismatched(engine.fingerprint, pub.fingerprint(version, meta, flat))


def prepacked_counts(worker) -> dict[str, int]:
    return worker._prepacked_reload.counts()


def hf_greedy(model, tok, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0, top_k=None, top_p=None)
    return out[0, ids.shape[1]:].tolist()


def hf_logprobs(model, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
    full = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits[0, len(prompt_ids) - 1:-1].float(), -1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


# each starts a vLLM engine (the first in a process also imports vLLM): 63-102 s on an AVX2-only CPU
@pytest.mark.slow
@pytest.mark.parametrize("policy,reload,tp", [("tiny_tied", "prepacked", 1), ("tiny_untied", "prepacked", 1),
                                              ("tiny_tied", "layerwise", 1),
                                              pytest.param("tiny_untied", "prepacked", 2, marks=pytest.mark.slow)])
def test_vllm_matches_learner_after_sync(policy, reload, tp, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(request.getfixturevalue(policy))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMEngine(path, ModelConfig(dtype="float32", max_model_len=256),
                        EngineConfig(kv_cache_mb=32, cpu_weight_reload=reload, tensor_parallel_size=tp), on_cpu=True)
    assert engine.tp == tp  # the engine's real worker count: every worker joins the group
    pub = joined(engine)
    try:
        prompts = SHORT + LONG
        engine.generate(prompts, 1, 0.0, 24)  # fills the prefix cache with KV of the old weights
        for version in (1, 2):  # two syncs: the second must also replace what the first loaded
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            # the engine computes with exactly the weights sent (its fingerprint: a TP engine's workers' shares)
            assert sync(engine, pub, model, version) == []
            # a TP worker loads its shards through vLLM's loaders: the swap is for one worker
            assert engine.policy_version == version and engine.reload_mode == (reload if tp == 1 else "layerwise")
            if reload == "prepacked" and tp == 1:  # the bucket plan lays fused projections out: no shadow copies
                counts = engine.llm.collective_rpc(prepacked_counts)[0]
                assert counts["direct"] == counts["linear"] > 0, counts
            outs = engine.generate(prompts, 1, 0.0, 24)
            for prompt, (prompt_ids, samples) in zip(prompts, outs):
                got = samples[0].token_ids.tolist()
                assert got == hf_greedy(model, tok, prompt, 24)[:len(got)], f"greedy mismatch after sync {version}: {prompt[:30]}"
                diff = (hf_logprobs(model, prompt_ids.tolist(), got) - torch.from_numpy(samples[0].logprobs)).abs().max()
                assert diff < 1e-3, f"log-prob diff {diff} after sync {version}"
        # sampled (T=1) log-probs are the behaviour log-probs the loss uses: they must match too
        prompt_ids, samples = engine.generate(LONG[:1], 4, 1.0, 24)[0]
        for s in samples:
            diff = (hf_logprobs(model, prompt_ids.tolist(), s.token_ids.tolist()) - torch.from_numpy(s.logprobs)).abs().max()
            assert diff < 1e-3
        # a load that leaves one weight wrong (the fault drill) is caught, in its block only
        assert sync(engine, pub, model, 3, corrupt=True) == ["model"]
        assert sync(engine, pub, model, 4) == []  # and the next load repairs it
    finally:
        engine.close()
        pub.close_group("a")


def test_plan_buckets_splits_by_size_and_dtype():
    from exgrpo_async.weight_sync import plan_buckets

    named = [("a", torch.zeros(256)), ("b", torch.zeros(256)), ("c", torch.zeros(1024)), ("d", torch.zeros(4, dtype=torch.bfloat16))]
    meta = plan_buckets(named, bucket_bytes=2048)
    assert [[n for n, _, _ in b] for b in meta] == [["a", "b"], ["c"], ["d"]]
    assert meta[2][0][1] == "bfloat16" and meta[1][0][2] == [1024]


@pytest.mark.slow
def test_partial_broadcast_falls_back_to_layerwise(tiny_tied, request):
    """A broadcast that leaves some packed layers without weights cannot be swapped in whole: the worker
    falls back to vLLM's layerwise reload (logged), and the engine still serves exactly the new weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_tied)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMEngine(path, ModelConfig(dtype="float32", max_model_len=256), EngineConfig(kv_cache_mb=32), on_cpu=True)
    pub = joined(engine)
    try:
        sent = [(n, p) for n, p in model.named_parameters() if ".mlp." not in n]  # no MLP weights at all
        with torch.no_grad():
            for _, p in sent:
                p.add_(torch.randn_like(p) * 0.05)
        # the MLPs keep their old weights: the fingerprint names every MLP block, and nothing else
        assert sync(engine, pub, model, 1, sent) == [f"model.layers.{i}.mlp" for i in range(model.config.num_hidden_layers)]
        assert engine.reload_mode == "layerwise"
        for prompt, (prompt_ids, samples) in zip(SHORT, engine.generate(SHORT, 1, 0.0, 16)):
            got = samples[0].token_ids.tolist()
            assert got == hf_greedy(model, tok, prompt, 16)[:len(got)]
    finally:
        engine.close()
        pub.close_group("a")


@pytest.mark.slow
def test_a_bf16_engine_runs_the_weights_it_was_sent(tiny_tied):
    """The demo's precision where a CPU computes bf16 fast: a bf16 engine after a bf16 broadcast matches
    the publisher's fingerprint block by block. On CPUs with AVX-512-BF16 or AMX vLLM keeps the
    attention's bias in fp32 for its packed kernel; counted as stored, every attention block mismatched
    and every group of a bf16 run was rejected (actors/fingerprint.py `as_published`). Elsewhere bf16 is
    emulated, and this checks the same path at that speed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_tied), dtype=torch.float32).eval()
    engine = VLLMEngine(str(tiny_tied), ModelConfig(dtype="bfloat16", max_model_len=256), EngineConfig(kv_cache_mb=32),
                        on_cpu=True)
    pub = joined(engine)
    try:
        with torch.no_grad():  # trained weights: the biases too (a fresh model's are zeros, whose bits hide the dtype)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        pub.publish(1, list(model.named_parameters()), torch.bfloat16)
        _, meta, flat = pub.snapshot()
        t = threading.Thread(target=pub.send, args=("a", flat))
        t.start()
        engine.load_weights(meta, 1, fingerprint=True)
        t.join(timeout=60)
        assert mismatched(engine.fingerprint, pub.fingerprint(1, meta, flat)) == []
        assert engine.generate(SHORT[:1], 1, 0.0, 8)[0][1][0].token_ids.size > 0
    finally:
        engine.close()
        pub.close_group("a")
