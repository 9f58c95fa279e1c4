"""In-flight weight updates into a real vLLM AsyncLLM engine on CPU (the "stream" actor engine).

- `wait`: groups generating when the update starts finish on the old weights (none is cut), and after
  the update greedy output and log-probs equal the learner's new weights, also for requests queued
  while the engine was paused (they must not start before the commit);
- a prefetched broadcast changes nothing until it is committed: neither the receive buffers nor the
  pre-packed layers staged from them are the engine's weights (a received-but-uncommitted version must
  not leak into generation);
- `abort`: groups running at the update are cut and come back with finish_reason "abort", so the
  actor can resubmit them on the new weights.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from actors.engine import AsyncVLLMEngine
from exgrpo_async.config import EngineConfig, ModelConfig
from exgrpo_async.weight_sync import WeightPublisher
from tests.integration.test_weight_sync_vllm import LONG, SHORT, hf_greedy, hf_logprobs

pytestmark = [pytest.mark.slow,  # a vLLM AsyncLLM engine: about 60 s
              pytest.mark.usefixtures("as_in_an_actor_process")]


def perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def broadcast_in_thread(pub: WeightPublisher, model, version: int) -> tuple[list, threading.Thread]:
    pub.publish(version, list(model.named_parameters()))
    _, meta, flat = pub.snapshot()
    t = threading.Thread(target=pub.send, args=("a", flat))
    t.start()
    return meta, t


async def greedy(engine: AsyncVLLMEngine, prompts: list[str], n_tokens: int = 16):
    return await asyncio.gather(*(engine.generate_group(p, 1, 0.0, n_tokens) for p in prompts))


def assert_matches(model, tok, prompts, outs, what: str) -> None:
    for prompt, (prompt_ids, samples) in zip(prompts, outs):
        got = samples[0].token_ids.tolist()
        assert got == hf_greedy(model, tok, prompt, 16)[:len(got)], f"greedy mismatch {what}: {prompt[:30]}"
        diff = (hf_logprobs(model, prompt_ids.tolist(), got) - torch.from_numpy(samples[0].logprobs)).abs().max()
        assert diff < 1e-3, f"log-prob diff {diff} {what}"


@pytest.mark.slow  # an AsyncLLM engine: 31 s on an AVX2-only CPU
def test_in_flight_updates(tiny_tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_tied)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=60)
    prompts = SHORT + LONG

    async def scenario() -> None:
        engine = AsyncVLLMEngine(path, ModelConfig(dtype="float32", max_model_len=256), EngineConfig(kv_cache_mb=32), on_cpu=True)
        try:
            opener = threading.Thread(target=pub.open_group, args=("a", 2))
            opener.start()
            await engine.init_weight_sync("127.0.0.1", pub.port, "ws/a/", 2, "gloo", 60)
            opener.join()
            perturb(model)
            meta, t = broadcast_in_thread(pub, model, 1)
            await engine.load_weights(meta, 1)
            t.join(timeout=60)
            assert_matches(model, tok, prompts, await greedy(engine, prompts), "after the first load")

            # wait mode: long groups are generating while version 2 arrives and is loaded
            running = [asyncio.create_task(engine.generate_group(p, 4, 1.0, 200)) for p in SHORT]
            await asyncio.sleep(0.3)
            perturb(model)
            meta, t = broadcast_in_thread(pub, model, 2)
            update = asyncio.create_task(engine.update_in_flight(meta, 2, "wait"))
            while not update.done() and not await engine.llm.is_paused():  # the drain has begun: adds queue
                await asyncio.sleep(0.001)
            assert not update.done(), "the update ended before requests could be queued behind its pause"
            queued = asyncio.create_task(greedy(engine, prompts))
            timings = await update
            t.join(timeout=60)
            finished = await asyncio.gather(*running)
            assert all(s.finish_reason != "abort" for _, samples in finished for s in samples)
            assert engine.policy_version == 2 and 0 <= timings["stall"] <= timings["total"]
            assert engine.reload_mode == "prepacked"  # the default: staged in the prefetch thread, swapped in
            # queued while paused: they start after the resume, on the committed weights
            assert_matches(model, tok, prompts, await queued, "queued during an in-flight update")
            assert_matches(model, tok, prompts, await greedy(engine, prompts), "after an in-flight update")

            # a received but uncommitted broadcast must not reach the engine's weights
            v2_outs = await greedy(engine, prompts)
            v2_state = {k: v.clone() for k, v in model.state_dict().items()}
            perturb(model, 0.2)
            meta, t = broadcast_in_thread(pub, model, 3)
            await engine.llm.collective_rpc("ws_prefetch", args=(meta,))
            t.join(timeout=60)  # the whole broadcast is in the receive buffers now
            assert [o[1][0].token_ids.tolist() for o in await greedy(engine, prompts)] == \
                [o[1][0].token_ids.tolist() for o in v2_outs], "prefetched weights leaked into generation"
            await engine.llm.pause_generation(mode="wait", clear_cache=True)
            await engine.llm.collective_rpc("ws_commit")
            await engine.llm.reset_prefix_cache()
            await engine.llm.resume_generation()
            assert_matches(model, tok, prompts, await greedy(engine, prompts), "after commit")
            model.load_state_dict(v2_state)  # keep the learner where the engine is not: proves the check bites
            outs = await greedy(engine, prompts)
            assert [o[1][0].token_ids.tolist() for o in outs] != [o[1][0].token_ids.tolist() for o in v2_outs]

            # abort mode: groups running at the update are cut
            running = [asyncio.create_task(engine.generate_group(p, 4, 1.0, 200)) for p in SHORT]
            await asyncio.sleep(0.3)
            meta, t = broadcast_in_thread(pub, model, 4)
            await engine.update_in_flight(meta, 4, "abort")
            t.join(timeout=60)
            cut = await asyncio.gather(*running)
            assert any(s.finish_reason == "abort" for _, samples in cut for s in samples)
            assert_matches(model, tok, prompts, await greedy(engine, prompts), "after an abort-mode update")
        finally:
            await engine.close()
            pub.close_group("a")

    asyncio.run(scenario())
