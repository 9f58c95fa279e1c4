"""Benchmark evaluation (`exgrpo-async eval`): sample a saved model on math question files and score it.

Questions come from the training data loader (`load_pool`: JSONL, JSON array, parquet; malformed rows are
skipped and listed) and are rendered with the run's prompt settings. The actor's batch engine
(`VLLMEngine`) draws N samples per question and the actor's math-verify pool (`MathVerifier`) scores
them; a gold with alternatives (rllm Minerva) counts a sample correct when any alternative verifies.
Results are grouped by the row's data source (ExGRPO's valid.parquet mixes six) or else by file:
avg@N (mean reward), pass@N (share of questions with a correct sample), verifier timeouts and errors,
truncated completions. `--limit L` keeps the first L questions of each source.

A prompt that cannot fit the model's context (max_position_embeddings) together with `max_tokens` is
not generated and is counted as `too_long`. With `actors` > 1 the questions are dealt round-robin to
that many spawned engine processes, each pinned to its own CPU cores before torch is imported (on
CUDA: given its own GPUs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Sequence

from actors.verifier import MathVerifier
from exgrpo_async.config import EngineConfig, ModelConfig, RunConfig, VerifierConfig
from exgrpo_async.data import Question, load_pool, render_prompt, set_chat_template

log = logging.getLogger("exgrpo_async.eval")


class EvalError(ValueError):
    """A setting the evaluation cannot honour (such as more engine processes than cores)."""


@dataclass
class QuestionResult:
    qid: int                                                  # index in the loaded pool
    source: str                                               # data_source, else the file stem
    answer: str                                               # gold (alternatives not shown)
    rewards: list[float] = field(default_factory=list)        # one per sample; empty: too long, not generated
    statuses: list[str] = field(default_factory=list)         # verifier status per sample: ok | timeout | error
    finish_reasons: list[str] = field(default_factory=list)   # "stop", or "length" (hit max_tokens)
    tokens: list[int] = field(default_factory=list)           # completion length per sample
    completions: list[str] = field(default_factory=list)      # decoded samples (in the JSON on request)


@dataclass
class EvalJob:
    """Everything one engine process needs; picklable, it crosses the spawn boundary."""
    model: str
    model_cfg: ModelConfig
    engine_cfg: EngineConfig
    verifier_cfg: VerifierConfig
    samples: int
    temperature: float
    max_tokens: int
    seed: int
    threads: int


# ----------------------------------------------------------------------------- metrics
def aggregate(results: Sequence[QuestionResult]) -> dict[str, Any]:
    """avg@N, pass@N and counts over `results`; questions without samples count only in `too_long`."""
    done = [r for r in results if r.rewards]
    samples = sum(len(r.rewards) for r in done)
    count = lambda key, value: sum(getattr(r, key).count(value) for r in done)  # noqa: E731
    truncated = count("finish_reasons", "length")
    return {
        "questions": len(done),
        "too_long": len(results) - len(done),
        "samples": samples,
        "avg_at_n": mean(mean(r.rewards) for r in done) if done else None,
        "pass_at_n": mean(float(max(r.rewards) >= 1.0) for r in done) if done else None,  # correct: reward 1
        "verifier_timeouts": count("statuses", "timeout"),
        "verifier_errors": count("statuses", "error"),
        "truncated": truncated,
        "truncated_frac": truncated / samples if samples else None,
        "response_tokens_mean": mean(t for r in done for t in r.tokens) if samples else None,
    }


def summarize(results: Sequence[QuestionResult]) -> dict[str, Any]:
    """{"overall": aggregate(all), "by_source": {source: aggregate(its questions)}}, sources in file order."""
    sources = dict.fromkeys(r.source for r in results)
    return {"overall": aggregate(results),
            "by_source": {s: aggregate([r for r in results if r.source == s]) for s in sources}}


def format_table(report: dict[str, Any]) -> str:
    """The on-screen table: one row per data source, then the overall row."""
    n = report["samples"]
    head = f"{'source':<28}{'questions':>10}{f'avg@{n}':>9}{f'pass@{n}':>9}{'truncated':>11}{'timeouts':>10}" \
           f"{'errors':>8}{'too_long':>10}"
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    rows = [head, "-" * len(head)]
    for name, m in [*report["by_source"].items(), ("overall", report["overall"])]:
        rows.append(f"{name[:27]:<28}{m['questions']:>10}{fmt(m['avg_at_n']):>9}{fmt(m['pass_at_n']):>9}"
                    f"{m['truncated']:>11}{m['verifier_timeouts']:>10}{m['verifier_errors']:>8}{m['too_long']:>10}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- data
def prepare(files: Sequence[str], limit: int | None, tokenizer: Any, template: str, system_prompt: str | None,
            use_chat_template: bool) -> tuple[list[Question], list[str], list[str]]:
    """(questions, their prompts, skipped bad rows): the first `limit` questions of each data source."""
    pool = load_pool(files, skip_bad_rows=True)
    seen: Counter[str] = Counter()
    questions = []
    for q in pool.questions:
        seen[q.source] += 1
        if limit is None or seen[q.source] <= limit:
            questions.append(q)
    prompts = [render_prompt(q, template, system_prompt, use_chat_template, tokenizer) for q in questions]
    return questions, prompts, pool.skipped


# ----------------------------------------------------------------------------- generation + scoring
def run_shard(job: EvalJob, prompts: list[str], golds: list[list[str]],
              results: list[QuestionResult]) -> list[QuestionResult]:
    """Generate `job.samples` completions per prompt and score each against its golds (any may match)."""
    if not prompts:
        return results
    import torch

    from actors.engine import VLLMEngine

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        torch.set_num_threads(job.threads)
    v = job.verifier_cfg
    # the workers import while the engine starts
    with MathVerifier(v.workers, v.timeout_s, v.require_think, v.memory_limit_mb, v.function) as verifier:
        engine = VLLMEngine(job.model, job.model_cfg, job.engine_cfg, on_cpu=on_cpu, seed=job.seed)
        try:
            t0 = time.perf_counter()
            outs = engine.generate(prompts, job.samples, job.temperature, job.max_tokens)
            log.info("generated %d x %d samples in %.1f s", len(prompts), job.samples, time.perf_counter() - t0)
            tokenizer = engine.get_tokenizer()
        finally:
            engine.close()
        for r, (_, samples) in zip(results, outs):
            r.completions = [tokenizer.decode(s.token_ids.tolist(), skip_special_tokens=False) for s in samples]
            r.finish_reasons = [s.finish_reason for s in samples]
            r.tokens = [len(s.token_ids) for s in samples]
        items = [(text, g) for r, gs in zip(results, golds) for text in r.completions for g in gs]
        rows = [{"question_id": r.qid, "data_source": r.source, "prompt": p, "purpose": "eval"}  # + "answer": g
                for r, p, gs in zip(results, prompts, golds) for _ in r.completions for _ in gs]
        scores = iter(verifier.score(items, rows))
    for r, gs in zip(results, golds):
        for _ in r.completions:
            per_gold = [next(scores) for _ in gs]
            reward = max(s for s, _ in per_gold)
            r.rewards.append(reward)
            r.statuses.append("ok" if reward > 0 else next((st for _, st in per_gold if st != "ok"), "ok"))
    return results


def _shard_process(shard: int, cores: set[int] | None, gpus: str | None, job: EvalJob, prompts: list[str],
                   golds: list[list[str]], results: list[QuestionResult], out: Any) -> None:
    if cores:
        os.sched_setaffinity(0, cores)  # before torch starts its threads
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    os.environ["OMP_NUM_THREADS"] = str(job.threads)
    from exgrpo_async.logs import setup_logging

    setup_logging("eval", str(shard))
    if gpus is None:
        from actors.engine import no_compiling_on_cpu

        no_compiling_on_cpu()
    try:
        out.put((shard, run_shard(job, prompts, golds, results), None))
    except BaseException:
        out.put((shard, None, traceback.format_exc()))


def generate_and_score(job: EvalJob, prompts: list[str], golds: list[list[str]], results: list[QuestionResult],
                       actors: int = 1) -> list[QuestionResult]:
    """`run_shard` here (actors=1) or on `actors` spawned processes, each with a round-robin share."""
    if actors <= 1:
        return run_shard(job, prompts, golds, results)
    import torch

    gpu = torch.cuda.is_available()
    per = job.engine_cfg.tensor_parallel_size if gpu else job.threads
    if gpu:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        pool = visible.split(",")
    else:
        pool = sorted(os.sched_getaffinity(0))
    if actors * per > len(pool):
        raise EvalError(f"--actors {actors} needs {actors * per} {'GPUs' if gpu else 'CPU cores'} ({per} each), "
                         f"{len(pool)} available")
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or vLLM state
    out = ctx.Queue()
    shards = [list(range(i, len(prompts), actors)) for i in range(actors)]
    procs = []
    for i, idx in enumerate(shards):
        mine = pool[i * per:(i + 1) * per]
        place = (None, ",".join(map(str, mine))) if gpu else (set(mine), None)
        args = (i, *place, dataclasses.replace(job, seed=job.seed + i), [prompts[j] for j in idx],
                [golds[j] for j in idx], [results[j] for j in idx], out)
        procs.append(ctx.Process(target=_shard_process, args=args, name=f"eval-{i}"))
        procs[-1].start()
    got: dict[int, list[QuestionResult]] = {}
    try:
        while len(got) < actors:
            try:
                i, part, err = out.get(timeout=5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"eval process {dead[0]} exited ({procs[dead[0]].exitcode}) without results")
                continue
            if err is not None:
                raise RuntimeError(f"eval process {i} failed:\n{err}")
            got[i] = part
    finally:
        for p in procs:
            p.join(timeout=30 if len(got) == actors else 0)
            if p.is_alive():
                p.terminate()
                p.join()
    merged = list(results)
    for i, idx in enumerate(shards):
        for j, r in zip(idx, got[i]):
            merged[j] = r
    return merged


# ----------------------------------------------------------------------------- the command
def default_out(model: str) -> Path:
    """eval-<timestamp>.json next to a local model folder (in the current folder if that is not writable)."""
    path = Path(model).expanduser().resolve()
    folder = path.parent if path.is_dir() and os.access(path.parent, os.W_OK) else Path.cwd()
    return folder / time.strftime("eval-%Y%m%d-%H%M%S.json")


def evaluate(cfg: RunConfig, model: str, files: Sequence[str], samples: int, temperature: float, max_tokens: int,
             limit: int | None = None, actors: int = 1, seed: int = 0) -> dict[str, Any]:
    """The report: settings, `overall` and `by_source` metrics, and `questions` (one QuestionResult each).
    Prompt settings come from `cfg.data`, dtype from `cfg.model`, engine/verifier/threads from `cfg.actor`;
    greedy decoding (temperature 0) draws one sample per question."""
    from transformers import AutoConfig, AutoTokenizer

    t0, d = time.time(), cfg.data
    if temperature == 0 and samples > 1:  # vLLM refuses n > 1 for greedy; the samples would be identical
        log.warning("temperature 0 (greedy): 1 sample per question instead of %d", samples)
        samples = 1
    tokenizer = AutoTokenizer.from_pretrained(model)
    set_chat_template(tokenizer, d.chat_template)
    questions, prompts, skipped = prepare(files, limit, tokenizer, d.prompt_template, d.system_prompt,
                                          d.use_chat_template)
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    context = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    fits = [i for i, n in enumerate(lengths) if context is None or n + max_tokens <= context]
    results = [QuestionResult(q.qid, q.source, q.answer) for q in questions]
    max_model_len = max([lengths[i] for i in fits], default=0) + max_tokens
    log.info("%d questions from %d files (%d too long, %d bad rows skipped); %d samples each, max_model_len %d",
             len(questions), len(files), len(questions) - len(fits), len(skipped), samples, max_model_len)
    if fits:
        job = EvalJob(model, ModelConfig(path=model, dtype=cfg.model.dtype, max_model_len=max_model_len),
                      cfg.actor.engine, cfg.actor.verifier, samples, temperature, max_tokens, seed, cfg.actor.threads)
        golds = [[questions[i].answer, *questions[i].meta.get("alt_answers", [])] for i in fits]
        done = generate_and_score(job, [prompts[i] for i in fits], golds, [results[i] for i in fits], actors)
        for i, r in zip(fits, done):
            results[i] = r
    return {"model": model, "files": [str(f) for f in files], "samples": samples, "temperature": temperature,
            "max_tokens": max_tokens, "limit": limit, "actors": actors, "seed": seed, "max_model_len": max_model_len,
            "prompt_template": d.prompt_template, "system_prompt": d.system_prompt,
            "use_chat_template": d.use_chat_template, "require_think": cfg.actor.verifier.require_think,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)), "seconds": time.time() - t0,
            "skipped_rows": skipped, **summarize(results), "questions": results}


def write_report(report: dict[str, Any], out: Path, save_completions: bool = False) -> None:
    """The report as JSON; per-question completions only with `save_completions`."""
    rows = [{k: v for k, v in dataclasses.asdict(r).items() if save_completions or k != "completions"}
            for r in report["questions"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**report, "questions": rows}, indent=1) + "\n")
