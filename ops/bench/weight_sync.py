"""Weight sync cost: learner -> running vLLM engine over gloo, against a bare gloo broadcast of the same bytes.

Setup (chosen to match a real run): the learner is a separate spawned process holding the Hugging Face
model and a `WeightPublisher` (rank 0, TCPStore master); it publishes, then serves commands from the
main process over a pipe, the way the learner's sync thread serves an actor's sync request. The main
process is the actor: a `VLLMEngine` on CPU with its engine core in-process (max_model_len 256,
EngineConfig(kv_cache_mb=64)), so its vLLM worker, and with it the `WeightReceiver`, lives here too.
Each model runs once per `cpu_weight_reload` mode (a fresh engine and learner each): "prepacked" (the
default, actors/cpu_reload.py) and "layerwise" (vLLM's layerwise reload).
Both processes run torch with 1 thread, as the demo's actors and learner do.

Models: the toy policy (exgrpo_async.toy.task.build_model, ~1M params, tied) and a ~113M Qwen2 (hidden 768,
12 layers, 12 heads, head_dim 64, intermediate 3072, vocab 100, tied). Per model 1 warm-up + 5 repeats;
each repeat runs, interleaved (clock always on the main process, request -> both sides done):
- sync: the learner replies with `meta` and broadcasts every bucket (`WeightPublisher.send`); main runs
  `engine.load_weights(meta)`: receive + reload (prepacked: each bucket loaded into shadows and its
  layers re-packed while the next is in flight, then the swap; layerwise: vLLM's layerwise reload and
  the tied lm_head re-pack) + prefix-cache reset.
- bare: the same bucket sizes (same plan_buckets, same bucket_mb) broadcast over another `make_group`
  group between the same two processes into flat tensors allocated once and reused; no vLLM.
  The target is against this one.
- bare fresh: the same into tensors newly allocated each time (what WeightReceiver did before it
  kept its buffers; shows the page-fault cost of fresh 64 MB buffers on this VM).
Diagnostics, same repeats: `reload only` = the worker's reload from weights already in memory (no
network); `commit` = its last step, the part an in-flight update runs with the engine stopped
(prepacked only: the swap; layerwise has no such split).
`publish` is the learner's packing into its persistent flat buffers after a train step; not part of a sync.
Target: sync <= 1.5x bare, with the default (prepacked) reload.

    .venv/bin/python ops/bench/weight_sync.py [--out bench_out/weight_sync.json] [--bucket-mb 64] [--models toy,113m]
        [--reloads prepacked,layerwise]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from exgrpo_async.config import EngineConfig, ModelConfig, WeightSyncConfig
from exgrpo_async.weight_sync import Meta, WeightPublisher, _broadcast, _numel, make_group

REPO = Path(__file__).resolve().parents[2]
HOST, TIMEOUT_S, WARMUP, REPEATS, TARGET = "127.0.0.1", 120.0, 1, 5, 1.5


def build_policy(out: Path, size: str) -> int:
    """Save the toy tokenizer plus a tied Qwen2 of the given size; returns the parameter count."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from exgrpo_async.toy.task import build_model, build_tokenizer

    build_tokenizer(out)
    if size == "toy":
        model = build_model(seed=0)
    else:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=100, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32"))
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def learner(path: str, bucket_mb: int, conn: Connection) -> None:
    """Rank 0 in its own process: publishes the model, then serves open / publish / send / bare / close."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pub = WeightPublisher(HOST, 0, "gloo", torch.device("cpu"), bucket_mb, TIMEOUT_S)
    conn.send(pub.port)
    bare_pg, version = None, 0
    while (cmd := conn.recv()) != "close":
        t0 = time.perf_counter()
        if cmd == "open":
            pub.open_group("a", 2)
            bare_pg = make_group(HOST, pub.port, "bare/", 0, 2, "gloo", TIMEOUT_S, store=pub.store)
        elif cmd == "publish":
            pub.publish(version := version + 1, list(model.named_parameters()))
        elif cmd == "send":
            v, meta, flat = pub.snapshot()
            conn.send((v, meta))  # the server replies with meta, then its sync thread broadcasts
            t0 = time.perf_counter()
            pub.send("a", flat)
        elif cmd == "bare":
            for w in [_broadcast(bare_pg, t) for t in pub.snapshot()[2]]:
                w.wait()
        conn.send(time.perf_counter() - t0)
    pub.close_group("a")
    bare_pg.shutdown()


def worker_reload(worker, meta: Meta, bufs: list[torch.Tensor]) -> float:
    """Runs inside the vLLM worker (layerwise mode): vLLM's layerwise reload of weights already in
    memory (no network): the part of a sync that a pre-packed swap replaces."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    t0 = time.perf_counter()
    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    for i, bucket in enumerate(meta):
        ends = list(itertools.accumulate(_numel(s) for _, _, s in bucket))
        model.load_weights(weights=[(n, bufs[i][end - _numel(s):end].view(s)) for (n, _, s), end in zip(bucket, ends)])
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # the tied-head re-pack
    return time.perf_counter() - t0


def worker_restage(worker, n_buckets: int) -> tuple[float, float]:
    """Runs inside the vLLM worker (prepacked mode): stage every bucket already in the receive buffers
    and commit, no network; returns (stage + commit seconds, commit seconds)."""
    fast = worker._prepacked_reload
    t0 = time.perf_counter()
    for i in range(n_buckets):
        fast.stage(i)
    t1 = time.perf_counter()
    fast.commit()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def timed(conn: Connection, cmd: str, local) -> tuple[float, float]:
    """(wall seconds on main from the request until both sides are done, the learner's seconds)."""
    t0 = time.perf_counter()
    conn.send(cmd)
    local(conn.recv() if cmd == "send" else None)
    learner_s = conn.recv()
    return time.perf_counter() - t0, learner_s


def bench_model(size: str, bucket_mb: int, reload: str) -> dict:
    from actors.engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_policy(Path(tmp), size)
        conn, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=learner, args=(tmp, bucket_mb, child), daemon=True)
        proc.start()
        port = conn.recv()
        engine = VLLMEngine(tmp, ModelConfig(dtype="float32", max_model_len=256),
                            EngineConfig(kv_cache_mb=64, cpu_weight_reload=reload), on_cpu=True)
        try:
            conn.send("open")
            engine.init_weight_sync(HOST, port, "ws/a/", 2, "gloo", TIMEOUT_S)
            bare_pg = make_group(HOST, port, "bare/", 1, 2, "gloo", TIMEOUT_S)
            conn.recv()
            rows, split, bufs = [], {}, None
            rpc = engine.llm.collective_rpc

            def sync(vm: tuple[int, Meta]) -> None:
                split["load_weights_s"] = engine.load_weights(vm[1], vm[0])
                split["meta"] = vm[1]

            def bare_into(fresh: bool):
                return lambda _: [w.wait() for w in [_broadcast(bare_pg, torch.empty_like(b) if fresh else b)
                                                     for b in bufs]]

            for i in range(WARMUP + REPEATS):
                _, publish_s = timed(conn, "publish", lambda _: None)
                sync_s, send_s = timed(conn, "send", sync)
                assert engine.reload_mode == reload, f"asked for {reload}, the worker used {engine.reload_mode}"
                meta = split["meta"]
                if bufs is None:  # allocated and touched once, reused by every later repeat
                    bufs = [torch.zeros(sum(_numel(s) for _, _, s in b), dtype=getattr(torch, b[0][1])) for b in meta]
                bare_s, bare_send_s = timed(conn, "bare", bare_into(fresh=False))
                bare_fresh_s, _ = timed(conn, "bare", bare_into(fresh=True))
                if reload == "layerwise":
                    reload_s, commit_s = rpc(worker_reload, args=(meta, bufs))[0], None  # no split
                else:
                    reload_s, commit_s = rpc(worker_restage, args=(len(meta),))[0]
                if i >= WARMUP:
                    rows.append({"sync_s": sync_s, "load_weights_s": split["load_weights_s"],
                                 "publisher_send_s": send_s,
                                 "bare_s": bare_s, "bare_send_s": bare_send_s, "bare_fresh_s": bare_fresh_s,
                                 "reload_only_s": reload_s, "commit_s": commit_s, "publish_s": publish_s})
            outs = engine.generate(["<bos>12+34="], 1, 0.0, 8)  # the engine still works after the syncs
            assert len(outs[0][1][0].token_ids) > 0
            conn.send("close")
            bare_pg.shutdown()
        finally:
            engine.close()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    med = {k: statistics.median(r[k] for r in rows) if rows[0][k] is not None else None for k in rows[0]}
    return {"model": size, "reload": reload, "params": n_params, "bytes": sum(b.numel() * b.element_size() for b in bufs),
            "buckets": len(bufs), "bucket_mb": bucket_mb, "repeats": rows, "median": med,
            "ratio": med["sync_s"] / med["bare_s"], "ratio_vs_bare_fresh": med["sync_s"] / med["bare_fresh_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench_out" / "weight_sync.json"))
    ap.add_argument("--bucket-mb", type=int, default=WeightSyncConfig().bucket_mb)
    ap.add_argument("--models", default="toy,113m")
    ap.add_argument("--reloads", default="prepacked,layerwise", help="actor.engine.cpu_weight_reload values to compare")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    torch.set_num_threads(1)
    results = [bench_model(m, args.bucket_mb, r) for m in args.models.split(",") for r in args.reloads.split(",")]
    cols = ["sync_s", "bare_s", "bare_fresh_s", "load_weights_s", "publisher_send_s", "reload_only_s", "commit_s",
            "publish_s"]
    print(f"bucket_mb={args.bucket_mb}; seconds, median of {REPEATS} after {WARMUP} warm-up")
    print(f"{'model':>6} {'reload':>9} {'params':>7} {'MB':>6} {'bkts':>4} " + " ".join(f"{c[:-2]:>14}" for c in cols)
          + f" {'sync/bare':>9} {'sync/fresh':>10}  target")
    for r in results:
        r["pass"] = r["ratio"] <= TARGET
        print(f"{r['model']:>6} {r['reload']:>9} {r['params'] / 1e6:>6.1f}M {r['bytes'] / 1e6:>6.1f} {r['buckets']:>4} "
              + " ".join(f"{r['median'][c]:>14.4f}" if r['median'][c] is not None else f"{'-':>14}" for c in cols)
              + f" {r['ratio']:>9.2f} {r['ratio_vs_bare_fresh']:>10.2f}  {'PASS' if r['pass'] else 'FAIL'}")
    ok = all(r["pass"] for r in results if r["reload"] == "prepacked")
    print(f"target: sync <= {TARGET}x bare gloo broadcast with the default (prepacked) reload: {'PASS' if ok else 'FAIL'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "target_ratio": TARGET, "pass": ok}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
