"""How the warm-started toy policy's pass rates spread over questions: the evidence issue 35 asks for before a
graded pool (ExGRPO's buckets need questions the policy solves sometimes, not never or always).

For `--per-kind` training questions of each test kind, `--samples` completions each (HF generate, the RL
sampling distribution: T=1, no top-k/top-p): the histogram of per-question pass rates (k of K correct), per
kind, and per "carry level" within each kind (column carries or borrows the worked solution makes: the
difficulty a graded pool would vary). Writes a table to stdout and JSON to `--out`.

    .venv/bin/python ops/bench/learning/pass_rates.py --per-kind 80 --samples 8 --out bench_out/pass_rates.json \
        [--model RUN/final ...]      # trained policies beside the warm start, on the same questions
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from exgrpo_async.toy import task as toy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402


def carry_level(kind: str, problem: str) -> int:
    """Carries (or borrows) the worked solution of a toy question makes; 0 for the easiest form."""
    n = [int(x) for x in re.findall(r"\d+", problem)]
    if kind in ("add2", "add3"):
        a, b = n
        carries, c = 0, 0
        while a or b:
            c = (a % 10 + b % 10 + c) // 10
            carries += c
            a, b = a // 10, b // 10
        return carries
    if kind == "mul21":
        a, b = n
        return int(a % 10 * b >= 10) + int(a * b >= 100)
    if kind == "sub2":
        a, b = n
        return 0 if b < 10 else 1 + int(a % 10 < b % 10)
    if kind == "addmul":
        a, b, c = n
        return int(b * c >= 10) + int(a % 10 + b * c % 10 >= 10)
    raise ValueError(f"unknown kind {kind!r}")


def pass_rates(model, tokenizer, rows: list[dict], samples: int, seed: int) -> list[int]:
    """Correct completions out of `samples` for each row (sampled as in RL)."""
    import torch

    tokenizer.padding_side = "left"
    model.eval()
    torch.manual_seed(seed)
    wins: list[int] = []
    for i in range(0, len(rows), 32):
        chunk = rows[i:i + 32]
        enc = tokenizer([toy.PROMPT_TEMPLATE.format(problem=r["problem"]) for r in chunk for _ in range(samples)],
                        padding=True, return_tensors="pt")
        with torch.no_grad():
            seqs = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=64,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        scores = toy.score_completions(tokenizer, seqs[:, enc["input_ids"].shape[1]:].tolist(),
                                       [r["answer"] for r in chunk for _ in range(samples)])
        wins += [int(sum(scores[j * samples:(j + 1) * samples])) for j in range(len(chunk))]
    return wins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-kind", type=int, default=80)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=600, help="the warm start's SFT steps (the demo's: 600)")
    ap.add_argument("--cache-dir", default="~/.cache/exgrpo_async")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", action="append", default=[],
                    help="a policy folder to measure too (a run's final/, say); repeatable; the warm start always")
    bench.add_out(ap, "pass_rates.json")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(2)
    paths = toy.ensure_toy_assets(Path(a.cache_dir), 0, a.sft_steps)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(paths["model"]))
    pool = [json.loads(line) for line in open(paths["train"])]
    rng = random.Random(a.seed)
    rows = []
    for kind in toy.TEST_KINDS:
        of_kind = [r for r in pool if r["kind"] == kind]
        rows += rng.sample(of_kind, min(a.per_kind, len(of_kind)))
    K = a.samples
    results = {}
    for name in [str(paths["model"])] + a.model:
        print(f"\n{name}")
        results[name] = _measure(AutoModelForCausalLM.from_pretrained(name), tokenizer, rows, K, a.seed)
    bench.write_json(a.out, {"samples": K, "per_kind": a.per_kind, "policies": results}, indent=1)


def _measure(model, tokenizer, rows: list[dict], K: int, seed: int) -> dict:
    t0 = time.time()
    wins = pass_rates(model, tokenizer, rows, K, seed)
    by_kind: dict[str, Counter] = defaultdict(Counter)
    by_level: dict[str, Counter] = defaultdict(Counter)
    for r, w in zip(rows, wins):
        by_kind[r["kind"]][w] += 1
        by_level[f"{r['kind']} carries={carry_level(r['kind'], r['problem'])}"][w] += 1

    def line(name: str, c: Counter) -> dict:
        n = sum(c.values())
        never, always = c[0], c[K]
        mid = n - never - always
        mean = sum(k * v for k, v in c.items()) / (n * K)
        print(f"| {name} | {n} | {mean:.2f} | {never / n:.2f} | {mid / n:.2f} | {always / n:.2f} |")
        return {"questions": n, "mean_pass_rate": mean, "never": never / n, "sometimes": mid / n,
                "always": always / n, "histogram": {str(k): c[k] for k in range(K + 1)}}

    print(f"| questions | n | mean pass rate | 0/{K} | 1-{K - 1}/{K} | {K}/{K} |\n|---|---|---|---|---|---|")
    out = {"all": line("all", sum(by_kind.values(), Counter()))}
    out["by_kind"] = {k: line(k, by_kind[k]) for k in toy.TEST_KINDS}
    out["by_carry_level"] = {k: line(k, by_level[k]) for k in sorted(by_level)}
    out["seconds"] = time.time() - t0
    return out


if __name__ == "__main__":
    main()
