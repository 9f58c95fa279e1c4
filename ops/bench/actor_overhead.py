"""Actor-loop overhead: rollouts/s of the real actor loop against bare vLLM generate on the same prompts.

Workload: the cached toy policy (exgrpo_async.toy.task.ensure_toy_assets), the first (1 + 16) * 8 training
questions in order, batches of 8 questions, K=8 samples each, T=1, max_tokens 64. The first batch is a
warm-up in both runs; the 16 batches after it are timed (1024 rollouts). Both runs happen in a spawned
process pinned to the same core with 1 torch thread, as `exgrpo-async train` runs an actor (the
verifier workers the actor starts inherit that core); engine start-up is outside both clocks.
- bare: `VLLMEngine.generate` (the engine config the actor gets: in-process core, 64 MiB KV cache,
  seed 1 = learner seed 0 + actor index 1), one call per batch; clock = sum of the timed calls. Run
  before and after the actor (bare, actor, bare) and averaged, since this VM's speed drifts.
- actor: the real `actors.loop.run()` against the real learner shell in this process (`LearnerServer` +
  `Dispatcher` + a `WeightPublisher` that publishes version 0: hello -> welcome, resync -> sync ->
  broadcast, then work). The dispatcher hands out the same questions in the same order, 8 per request.
  Clock on the learner: from the arrival of the warm-up batch's last group to the arrival of the last
  group (request work + generate + decode + verify + encode + send, 16 times).
Breakdown of the actor's window: the actor process wraps (for timing only) VLLMEngine.generate,
MathVerifier.score, encode_rollouts, ActorSocket.send (rollout messages) and ActorSocket.request (work
requests); "other" is the rest (token decode, building groups, Python). Same seed and prompts, so both
runs sample the same tokens (the tokens column shows it). Target: actor >= 90% of bare.

    .venv/bin/python ops/bench/actor_overhead.py [--out bench_out/actor_overhead.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing as mp
import os
import queue
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K, Q_PER_BATCH, BATCHES, WARMUP, MAX_TOKENS, TEMP, TARGET = 8, 8, 16, 1, 64, 1.0, 0.9
N_QUESTIONS = (WARMUP + BATCHES) * Q_PER_BATCH


def pin(core: int) -> None:
    """Like actors/main.py: pin before torch starts its threads, 1 thread."""
    os.sched_setaffinity(0, {core})
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    torch.set_num_threads(1)


def bare_proc(model_path: str, prompts: list[str], core: int, out: mp.Queue) -> None:
    pin(core)
    from actors.engine import VLLMEngine
    from exgrpo_async.config import RunConfig

    cfg = RunConfig()
    engine = VLLMEngine(model_path, cfg.model, cfg.actor.engine, on_cpu=True, seed=cfg.learner.seed + 1)
    secs, tokens = [], 0
    for b in range(WARMUP + BATCHES):
        t0 = time.perf_counter()
        outs = engine.generate(prompts[b * Q_PER_BATCH:(b + 1) * Q_PER_BATCH], K, TEMP, MAX_TOKENS)
        if b >= WARMUP:
            secs.append(time.perf_counter() - t0)
            tokens += sum(len(s.token_ids) for _, samples in outs for s in samples)
    engine.close()
    out.put({"batch_seconds": secs, "tokens": tokens})


def actor_proc(address: str, core: int, out: mp.Queue) -> None:
    pin(core)
    import actors.loop as loop
    from actors.engine import VLLMEngine
    from exgrpo_async.logs import setup_logging
    from exgrpo_async.transport import ActorSocket

    setup_logging("actor", str(os.getpid()))
    times: dict[str, list[float]] = {k: [] for k in ("generate", "verify", "encode", "send", "request")}

    def timed(name: str, fn, keep=lambda args, result: True):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            if keep(args, result):
                times[name].append(time.perf_counter() - t0)
            return result
        return wrapper

    VLLMEngine.generate = timed("generate", VLLMEngine.generate)
    loop.MathVerifier.score = timed("verify", loop.MathVerifier.score)
    loop.encode_rollouts = timed("encode", loop.encode_rollouts)
    ActorSocket.send = timed("send", ActorSocket.send, lambda a, r: len(a[1]) == 4)  # rollout messages only
    ActorSocket.request = timed("request", ActorSocket.request, lambda a, r: r[0]["t"] == "work")
    stats = loop.run(address, on_cpu=True)
    out.put({"stats": stats, "times": times})


def run_bare(paths: dict[str, Path], prompts: list[str], core: int) -> dict:
    q: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=bare_proc, args=(str(paths["model"]), prompts, core, q))
    proc.start()
    res = q.get(timeout=600)
    proc.join(60)
    return {**res, "seconds": sum(res["batch_seconds"])}


class TimedQueue(queue.Queue):
    """The server's inbox, stamping each group's arrival."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[float] = []

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        self.arrivals.append(time.perf_counter())
        super().put(item, block, timeout)


def run_actor(paths: dict[str, Path], prompts: list[str], rows: list[dict], core: int) -> dict:
    import torch

    from exgrpo_async.config import RunConfig
    from exgrpo_async.data import Question
    from exgrpo_async.weight_sync import WeightPublisher
    from learner.dispatch import Dispatcher
    from learner.model import load_policy, named_parameters_for_sync
    from learner.server import LearnerServer

    torch.set_num_threads(1)
    cfg = RunConfig.model_validate({
        "model": {"path": str(paths["model"])}, "data": {"train_files": [str(paths["train"])]},
        "rollout": {"samples_per_question": K, "temperature": TEMP, "max_new_tokens": MAX_TOKENS,
                    "questions_per_request": Q_PER_BATCH}})
    model, _ = load_policy(cfg.model.path, "float32", torch.device("cpu"))
    questions = [Question(i, r["problem"], None, r["answer"], "toy") for i, r in enumerate(rows)]
    # capacity = (version + 1 + max_staleness) * B: with B = every question and staleness 0, all of them at v0
    dispatcher = Dispatcher(itertools.count().__next__, N_QUESTIONS, K, TEMP, max_staleness=0)
    publisher = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), cfg.weight_sync.bucket_mb, 120.0)
    publisher.publish(0, named_parameters_for_sync(model))
    server = LearnerServer(cfg, dispatcher, publisher, "gloo", {"train": prompts, "eval": []},
                           {"train": questions, "eval": []}, cfg.model_dump_json())
    server.received = TimedQueue()
    server.start()
    out: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=actor_proc, args=(server.address, core, out))
    proc.start()
    groups = [server.received.get(timeout=600)[1] for _ in range(N_QUESTIONS)]
    server.stop(wait_for_actors_s=60)
    res = out.get(timeout=120)
    proc.join(60)
    arr = server.received.arrivals
    window = arr[-1] - arr[WARMUP * Q_PER_BATCH - 1]
    t = res["times"]
    n_groups = WARMUP * Q_PER_BATCH
    split = {"generate": sum(t["generate"][WARMUP:]), "verify": sum(t["verify"][WARMUP:]),
             "encode": sum(t["encode"][n_groups:]), "send": sum(t["send"][n_groups:]),
             "request": sum(t["request"][WARMUP:WARMUP + BATCHES])}
    split["other"] = window - sum(split.values())
    return {"seconds": window, "tokens": sum(g.num_tokens for g in groups[n_groups:]), "split_seconds": split,
            "actor_stats": res["stats"], "bad_messages": server.counters["bad_messages"],
            "versions": sorted({g.policy_version for g in groups})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench_out" / "actor_overhead.json"))
    args = ap.parse_args()
    from exgrpo_async.toy.task import PROMPT_TEMPLATE, ensure_toy_assets

    paths = ensure_toy_assets(Path("/tmp/toycache"), seed=0, sft_steps=600)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()[:N_QUESTIONS]]
    prompts = [PROMPT_TEMPLATE.format(problem=r["problem"]) for r in rows]
    core = sorted(os.sched_getaffinity(0))[-1]
    # bare, actor, bare: this VM's speed drifts by ~10% between runs, so the actor is compared with the
    # mean of a bare run before and after it
    bare_runs = [run_bare(paths, prompts, core)]
    actor = run_actor(paths, prompts, rows, core)
    bare_runs.append(run_bare(paths, prompts, core))
    n = BATCHES * Q_PER_BATCH * K
    bare = {"seconds": sum(r["seconds"] for r in bare_runs) / 2, "tokens": bare_runs[0]["tokens"], "runs": bare_runs}
    for r in (*bare_runs, bare, actor):
        r["rollouts_per_s"], r["tokens_per_s"] = n / r["seconds"], r["tokens"] / r["seconds"]
    ratio = actor["rollouts_per_s"] / bare["rollouts_per_s"]
    gen_share = actor["split_seconds"]["generate"] / actor["seconds"]
    print(f"toy policy, {BATCHES} timed batches x {Q_PER_BATCH} questions x K={K} = {n} rollouts, T={TEMP}, "
          f"max_tokens {MAX_TOKENS}, pinned to core {core}, 1 thread")
    print(f"{'run':>9} {'seconds':>8} {'rollouts/s':>11} {'tokens':>7} {'tokens/s':>9}")
    for name, r in (("bare 1", bare_runs[0]), ("actor", actor), ("bare 2", bare_runs[1]), ("bare mean", bare)):
        print(f"{name:>9} {r['seconds']:>8.3f} {r['rollouts_per_s']:>11.1f} {r['tokens']:>7d} "
              f"{r['tokens_per_s']:>9.0f}")
    print("actor window split (s): " + ", ".join(f"{k} {v:.3f} ({v / actor['seconds']:.1%})"
                                                 for k, v in actor["split_seconds"].items()))
    print(f"verify: {actor['split_seconds']['verify'] / n * 1e3:.2f} ms per completion; actor log stats: "
          f"{actor['actor_stats']}")
    print(f"actor rollouts/s vs its own generate time (same run, no drift): {gen_share:.1%}")
    ok = ratio >= TARGET
    print(f"target: actor >= {TARGET:.0%} of bare vLLM rollouts/s: {ratio:.1%} -> {'PASS' if ok else 'FAIL'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bare": bare, "actor": actor, "ratio": ratio, "actor_generate_share": gen_share,
                               "target": TARGET, "pass": ok}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
