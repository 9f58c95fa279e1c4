"""The built-in toy task and tiny policy for the CPU demo.

Job: make a tiny Qwen2 policy that RL can visibly improve on a 2-core CPU in minutes.
- Task: integer arithmetic prompts ("<bos>55+84=") answered with worked steps and a final
  \\boxed{N}; five test kinds from easy (add2) to hard (addmul), plus two SFT-only easy kinds.
- Tokenizer: one token per printable ASCII character, built with `tokenizers` (no hub).
- Model: Qwen2, hidden 128, 2 heads of head_dim 64 (vLLM's CPU attention rejects smaller heads),
  4 layers, tied embeddings, about 1.06M parameters.
- Warm start: a packed SFT phase of a fixed number of steps (packing needs use_cache=False, see
  docs/toy-task notes) so RL begins at roughly 20-50% accuracy with per-question pass rates spread
  between 0 and 1; its held-out accuracy is checked against WARM_START_BAND after each build.
Everything is cached in a folder keyed by the recipe, so a second demo run skips the SFT.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import math
import random
import re
import time
from pathlib import Path

TEST_KINDS = ("add2", "add3", "mul21", "sub2", "addmul")
SFT_ONLY_KINDS = ("add1", "mul1")
BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
PROMPT_TEMPLATE = BOS + "{problem}"


# ----------------------------------------------------------------------------- task
def make_question(kind: str, rng: random.Random) -> tuple[str, str, int]:
    """Returns (question text, worked completion without eos, integer answer)."""
    r = rng.randint
    if kind == "add1":
        a, b = r(0, 9), r(0, 9)
        return f"{a}+{b}=", f"\\boxed{{{a + b}}}", a + b
    if kind == "mul1":
        a, b = r(0, 9), r(0, 9)
        return f"{a}*{b}=", f"\\boxed{{{a * b}}}", a * b
    if kind == "add2":
        a, b = r(10, 99), r(10, 99)
        ta, tb = a // 10 * 10, b // 10 * 10
        steps = f"{ta}+{tb}={ta + tb},{a % 10}+{b % 10}={a % 10 + b % 10},{ta + tb}+{a % 10 + b % 10}={a + b},"
        return f"{a}+{b}=", steps + f"\\boxed{{{a + b}}}", a + b
    if kind == "add3":
        a, b = r(100, 999), r(100, 999)
        h = a // 100 * 100 + b // 100 * 100
        t = a // 10 % 10 * 10 + b // 10 % 10 * 10
        u = a % 10 + b % 10
        steps = (f"{a // 100 * 100}+{b // 100 * 100}={h},{a // 10 % 10 * 10}+{b // 10 % 10 * 10}={t},"
                 f"{a % 10}+{b % 10}={u},{h}+{t}+{u}={a + b},")
        return f"{a}+{b}=", steps + f"\\boxed{{{a + b}}}", a + b
    if kind == "mul21":
        a, b = r(10, 99), r(2, 9)
        ta = a // 10 * 10
        steps = f"{ta}*{b}={ta * b},{a % 10}*{b}={a % 10 * b},{ta * b}+{a % 10 * b}={a * b},"
        return f"{a}*{b}=", steps + f"\\boxed{{{a * b}}}", a * b
    if kind == "sub2":
        a = r(20, 99)
        b = r(2, a - 1)
        if b < 10:
            return f"{a}-{b}=", f"\\boxed{{{a - b}}}", a - b
        tb = b // 10 * 10
        steps = f"{a}-{tb}={a - tb},{a - tb}-{b % 10}={a - b},"
        return f"{a}-{b}=", steps + f"\\boxed{{{a - b}}}", a - b
    if kind == "addmul":
        a, b, c = r(10, 99), r(2, 9), r(2, 9)
        steps = f"{b}*{c}={b * c},{a}+{b * c}={a + b * c},"
        return f"{a}+{b}*{c}=", steps + f"\\boxed{{{a + b * c}}}", a + b * c
    raise ValueError(f"unknown toy question kind {kind!r}")


HELD_OUT_PER_KIND = 200  # 1,000 held-out questions: a paired before/after gain's standard error near 1.5 points
FIRST_PASS = 40  # the held-out set's first 40 of each kind are the 200 questions it held before it grew


def make_test_set(seed: int, per_kind: int = HELD_OUT_PER_KIND) -> list[dict]:
    """The held-out set: `per_kind` distinct questions of each test kind, fixed by `seed`. The first
    FIRST_PASS of each kind come first, in the order the 200-question set had; the rest follow."""
    rng = random.Random(seed)
    rows, seen = [], set()
    first = min(per_kind, FIRST_PASS)
    for count in (first, per_kind - first):
        for kind in TEST_KINDS:
            n = 0
            while n < count:
                q, _, ans = make_question(kind, rng)
                if q in seen:
                    continue
                seen.add(q)
                rows.append({"problem": q, "answer": str(ans), "kind": kind})
                n += 1
    return rows


def make_train_set(seed: int, n: int, exclude: set[str]) -> list[dict]:
    """RL training questions from the five test kinds, never one of `exclude`."""
    rng = random.Random(seed + 1)
    rows: list[dict] = []
    while len(rows) < n:
        kind = TEST_KINDS[rng.randrange(len(TEST_KINDS))]
        q, _, ans = make_question(kind, rng)
        if q not in exclude:
            rows.append({"problem": q, "answer": str(ans), "kind": kind})
    return rows


# ----------------------------------------------------------------------------- tokenizer + model
def build_tokenizer(out_dir: Path) -> None:
    """Character-level tokenizer (one token per printable ASCII char and newline), saved HF-style."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.save_pretrained(str(out_dir))


def build_model(seed: int):
    """A randomly initialised tiny Qwen2ForCausalLM matched to the character tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=100, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


# ----------------------------------------------------------------------------- SFT warm start
SFT_WARMUP_STEPS = 50

# Held-out accuracy of the freshly warm-started policy (greedy, and sampled avg@4 at T=1), checked after
# every build. Reference (docs/toy-task.md): 570 steps gave greedy 0.465, sampled 0.33 (k=8). Measured
# here, seed 0, 2 threads: 450 steps 0.235 / 0.13, 540 steps 0.36 / 0.255, 600 steps (the default)
# 0.455 / 0.355, 900 steps 0.80 / 0.68. Below the band RL sees too few correct answers, above it too
# little left to learn; outside it only prints a warning, the demo still runs.
WARM_START_BAND = {"greedy": (0.35, 0.60), "sampled": (0.25, 0.45)}
WARM_START_SAMPLES = 4


def _sft_stream(rng: random.Random, tokenizer, exclude: set[str]):
    kinds = TEST_KINDS + SFT_ONLY_KINDS
    while True:
        q, completion, _ = make_question(kinds[rng.randrange(len(kinds))], rng)
        if q not in exclude:  # held-out questions never reach SFT
            yield tokenizer(PROMPT_TEMPLATE.format(problem=q) + completion + EOS)["input_ids"]


def sft_lr_factor(step: int, steps: int, warmup: int = SFT_WARMUP_STEPS) -> float:
    """lr multiplier of 0-based `step` out of `steps`: linear warm-up over `warmup` steps (at most half
    the run), then cosine down to 10% at the last step."""
    warmup = min(warmup, steps // 2)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def sft(model, tokenizer, steps: int, exclude: set[str], seed: int, lr: float = 3e-3,
        rows: int = 16, row_len: int = 256, log_every: int = 50) -> dict:
    """Packed next-token SFT for exactly `steps` optimizer steps. Returns a small summary.

    The data stream and torch are seeded from `seed`, so on one machine (same torch, same threads) the
    result is the same every time; the step count, not the clock, fixes how far the policy gets."""
    import torch

    if steps <= 0:
        raise ValueError(f"sft needs a positive step count, got {steps}")
    torch.manual_seed(seed)  # the toy model has no dropout today, but any randomness in a step is fixed too
    rng = random.Random(seed + 2)
    stream = _sft_stream(rng, tokenizer, exclude)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    t0, loss_v = time.time(), float("nan")
    for step in range(steps):
        # pack examples into `rows` rows of `row_len` tokens, position ids restart per example
        inp, pos, lab = [], [], []
        for _ in range(rows):
            ids_row, pos_row, lab_row = [], [], []
            while True:
                ex = next(stream)
                if len(ids_row) + len(ex) > row_len:
                    break
                ids_row += ex
                pos_row += list(range(len(ex)))
                lab_row += [-100] + ex[1:]  # label -100 at each example start: no cross-example target
            pad = row_len - len(ids_row)
            inp.append(ids_row + [0] * pad)
            pos.append(pos_row + list(range(pad)))
            lab.append(lab_row + [-100] * pad)
        inp_t, pos_t, lab_t = torch.tensor(inp), torch.tensor(pos), torch.tensor(lab)
        for g in opt.param_groups:
            g["lr"] = lr * sft_lr_factor(step, steps)
        # use_cache=False: with a cache object transformers does not detect packed rows and
        # examples silently attend across boundaries.
        out = model(input_ids=inp_t, position_ids=pos_t, attention_mask=None, use_cache=False)
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, lab_t[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_v = float(loss.detach())
        if log_every and (step + 1) % log_every == 0:
            print(f"[sft] step {step + 1}/{steps} loss {loss_v:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    # sft_seconds is measured and informative only: nothing depends on it
    return {"sft_steps": steps, "sft_final_loss": loss_v, "sft_seconds": time.time() - t0}


# ----------------------------------------------------------------------------- warm-start check
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_int_correct(text: str, answer: str) -> bool:
    """The toy reward: the last \\boxed{N} of `text` holds an integer equal to `answer`."""
    found = _BOXED.findall(text)
    if not found:
        return False
    try:
        return int(found[-1].strip()) == int(answer)
    except ValueError:
        return False


def score_completions(tokenizer, completion_ids, answers: list[str]) -> list[float]:
    """0/1 rewards of generated completions (token ids after the prompt, one row per answer); each row
    is cut at its first eos and decoded without special tokens."""
    out = []
    for ids, answer in zip(completion_ids, answers):
        ids = [int(t) for t in ids]
        if tokenizer.eos_token_id in ids:
            ids = ids[:ids.index(tokenizer.eos_token_id)]
        out.append(float(boxed_int_correct(tokenizer.decode(ids, skip_special_tokens=True), answer)))
    return out


def policy_accuracy(model, tokenizer, rows: list[dict], samples: int = WARM_START_SAMPLES, seed: int = 0,
                    batch_size: int = 256, max_new_tokens: int = 64) -> dict:
    """Held-out accuracy of `model` on toy `rows` with HF generate: greedy, and sampled avg@`samples`
    (T=1.0, top_k=0, top_p=1.0, i.e. the RL sampling distribution). Prompts are rendered as the demo
    renders them (PROMPT_TEMPLATE); batches are left-padded."""
    import torch

    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    model.eval()

    def run(rows_in: list[dict], do_sample: bool) -> list[float]:
        scores: list[float] = []
        for i in range(0, len(rows_in), batch_size):
            chunk = rows_in[i:i + batch_size]
            enc = tokenizer([PROMPT_TEMPLATE.format(problem=r["problem"]) for r in chunk], padding=True,
                            return_tensors="pt")
            kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
            with torch.no_grad():
                seqs = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                      max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id, **kw)
            scores += score_completions(tokenizer, seqs[:, enc["input_ids"].shape[1]:].tolist(),
                                        [r["answer"] for r in chunk])
        return scores

    try:
        greedy = run(rows, do_sample=False)
        torch.manual_seed(seed)
        sampled = run([r for r in rows for _ in range(samples)], do_sample=True)
    finally:
        tokenizer.padding_side = side
    return {"greedy": sum(greedy) / len(greedy), "sampled": sum(sampled) / len(sampled)}


def band_rows(test: list[dict]) -> list[dict]:
    """The held-out rows the warm-start band was measured on: the first FIRST_PASS of each kind."""
    return test[:FIRST_PASS * len(TEST_KINDS)]


def band_warnings(acc: dict, band: dict = WARM_START_BAND) -> list[str]:
    """One line per accuracy figure outside its documented band (none when all are inside)."""
    return [f"{name} {acc[name]:.3f} not in [{lo:.2f}, {hi:.2f}]"
            for name, (lo, hi) in band.items() if not lo <= acc[name] <= hi]


RECIPE = (make_question, make_test_set, build_tokenizer, build_model, _sft_stream, sft_lr_factor, sft)


def recipe_key(seed: int, sft_steps: int) -> str:
    """The warm start's key: its seed and steps and the source of every function that makes the task,
    the model or the warm start (RECIPE). Any change to how the policy is made gives a fresh cache
    folder, so a stale one is never reused, and the shipped policy stops matching (toy/shipped.py)."""
    source = hashlib.sha256("".join(inspect.getsource(f) for f in RECIPE).encode()).hexdigest()
    blob = json.dumps({"v": 4, "seed": seed, "sft_steps": sft_steps, "kinds": TEST_KINDS + SFT_ONLY_KINDS,
                       "template": PROMPT_TEMPLATE, "held_out": [HELD_OUT_PER_KIND, FIRST_PASS],
                       "warmup": SFT_WARMUP_STEPS, "source": source})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_toy_assets(cache_dir: Path, seed: int, sft_steps: int, train_questions: int = 20000,
                      threads: int = 2) -> dict[str, Path]:
    """Build (or reuse) the warm-started tiny policy and the toy train/test JSONL files.

    Returns paths {"model", "train", "test"}. A folder is only used once its `done` marker exists, so
    an interrupted build is redone rather than half-reused. Processes that ask at once (two commands,
    the suite's parallel workers) take turns on a lock file; the later ones reuse the first's build.
    After the SFT the policy's held-out accuracy is measured and written to sft.json; outside
    WARM_START_BAND it prints a warning (never fails). The recipe the package ships (toy/shipped.py:
    the demo's seed and steps) is installed from its weights instead, in about a second.
    """
    root = Path(cache_dir).expanduser() / f"toy-{recipe_key(seed, sft_steps)}"
    paths = {"model": root / "policy", "train": root / "train.jsonl", "test": root / "test.jsonl"}
    if (root / "done").exists():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if not (root / "done").exists():
            import exgrpo_async.toy.shipped as toy_shipped

            if toy_shipped.matches(recipe_key(seed, sft_steps)):
                write_task_files(paths, seed, train_questions)
                toy_shipped.install(paths["model"], root / "sft.json", build_tokenizer)
                (root / "done").write_text("ok\n")
            else:
                _build_toy_assets(root, paths, seed, sft_steps, train_questions, threads)
    return paths


def write_task_files(paths: dict[str, Path], seed: int, train_questions: int) -> list[dict]:
    """Write the held-out (`paths["test"]`) and RL training (`paths["train"]`) JSONL files; returns the
    held-out rows (none of them is ever a training question)."""
    test = make_test_set(seed)
    exclude = {r["problem"] for r in test}
    for name, rows in (("test", test), ("train", make_train_set(seed, train_questions, exclude))):
        with open(paths[name], "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return test


def _build_toy_assets(root: Path, paths: dict[str, Path], seed: int, sft_steps: int, train_questions: int,
                      threads: int) -> None:
    import torch

    test = write_task_files(paths, seed, train_questions)
    exclude = {r["problem"] for r in test}
    from transformers import PreTrainedTokenizerFast

    build_tokenizer(paths["model"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(paths["model"]))
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(seed)
        print(f"[sft] warm-starting the tiny policy for {sft_steps} steps (cached in {root})", flush=True)
        summary = sft(model, tokenizer, sft_steps, exclude, seed)
        t0 = time.time()
        acc = policy_accuracy(model, tokenizer, band_rows(test), seed=seed)
    finally:
        torch.set_num_threads(prev)
    summary.update({"greedy_accuracy": acc["greedy"], "sampled_accuracy": acc["sampled"],
                    "sampled_k": WARM_START_SAMPLES, "accuracy_seconds": time.time() - t0,
                    "band": WARM_START_BAND})
    print(f"[sft] {sft_steps} steps in {summary['sft_seconds']:.0f}s, loss {summary['sft_final_loss']:.3f}; held-out "
          f"greedy {acc['greedy']:.3f}, sampled avg@{WARM_START_SAMPLES} {acc['sampled']:.3f}", flush=True)
    if bad := band_warnings(acc):
        print(f"[sft] warm start outside its documented band: {'; '.join(bad)} (toy.WARM_START_BAND; the demo "
              f"still runs, but RL may show little)", flush=True)
    model.save_pretrained(str(paths["model"]))
    (root / "sft.json").write_text(json.dumps(summary))
    (root / "done").write_text("ok\n")
