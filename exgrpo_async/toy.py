"""The built-in toy task and tiny policy for the CPU demo.

Job: make a tiny Qwen2 policy that RL can visibly improve on a 2-core CPU in minutes.
- Task: integer arithmetic prompts ("<bos>55+84=") answered with worked steps and a final
  \\boxed{N}; five test kinds from easy (add2) to hard (addmul), plus two SFT-only easy kinds.
- Tokenizer: one token per printable ASCII character, built with `tokenizers` (no hub).
- Model: Qwen2, hidden 128, 2 heads of head_dim 64 (vLLM's CPU attention rejects smaller heads),
  4 layers, tied embeddings, about 1.06M parameters.
- Warm start: a short packed SFT phase (packing needs use_cache=False, see docs/toy-task notes) so RL
  begins at roughly 20-50% accuracy with per-question pass rates spread between 0 and 1.
Everything is cached in a folder keyed by the recipe, so a second demo run skips the SFT.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
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


def make_test_set(seed: int, per_kind: int = 40) -> list[dict]:
    """The held-out set: `per_kind` distinct questions of each test kind, fixed by `seed`."""
    rng = random.Random(seed)
    rows, seen = [], set()
    for kind in TEST_KINDS:
        n = 0
        while n < per_kind:
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
def _sft_stream(rng: random.Random, tokenizer, exclude: set[str]):
    kinds = TEST_KINDS + SFT_ONLY_KINDS
    while True:
        q, completion, _ = make_question(kinds[rng.randrange(len(kinds))], rng)
        if q not in exclude:  # held-out questions never reach SFT
            yield tokenizer(PROMPT_TEMPLATE.format(problem=q) + completion + EOS)["input_ids"]


def sft(model, tokenizer, seconds: float, exclude: set[str], seed: int, lr: float = 3e-3,
        rows: int = 16, row_len: int = 256, log_every: int = 50) -> dict:
    """Packed next-token SFT for a wall-clock budget. Returns a small summary."""
    import torch

    rng = random.Random(seed + 2)
    stream = _sft_stream(rng, tokenizer, exclude)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    est_steps = max(100, int(seconds * 3))  # ~3 steps/s here; only shapes the cosine schedule
    warmup = 50
    model.train()
    t0, step, loss_v = time.time(), 0, float("nan")
    while time.time() - t0 < seconds:
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
        frac = min(1.0, step / warmup) if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / est_steps)))
        for g in opt.param_groups:
            g["lr"] = lr * frac
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
        step += 1
        if log_every and step % log_every == 0:
            print(f"[sft] step {step} loss {loss_v:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return {"sft_steps": step, "sft_final_loss": loss_v, "sft_seconds": time.time() - t0}


def recipe_key(seed: int, sft_seconds: float) -> str:
    blob = json.dumps({"v": 2, "seed": seed, "sft_seconds": sft_seconds, "kinds": TEST_KINDS + SFT_ONLY_KINDS})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_toy_assets(cache_dir: Path, seed: int, sft_seconds: float, train_questions: int = 20000,
                      threads: int = 2) -> dict[str, Path]:
    """Build (or reuse) the warm-started tiny policy and the toy train/test JSONL files.

    Returns paths {"model", "train", "test"}. A folder is only used once its `done` marker exists, so
    an interrupted build is redone rather than half-reused.
    """
    import torch

    root = Path(cache_dir).expanduser() / f"toy-{recipe_key(seed, sft_seconds)}"
    paths = {"model": root / "policy", "train": root / "train.jsonl", "test": root / "test.jsonl"}
    if (root / "done").exists():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    test = make_test_set(seed)
    exclude = {r["problem"] for r in test}
    for name, rows in (("test", test), ("train", make_train_set(seed, train_questions, exclude))):
        with open(paths[name], "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    from transformers import PreTrainedTokenizerFast

    build_tokenizer(paths["model"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(paths["model"]))
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(seed)
        print(f"[sft] warm-starting the tiny policy for {sft_seconds:.0f}s (cached in {root})", flush=True)
        summary = sft(model, tokenizer, sft_seconds, exclude, seed)
    finally:
        torch.set_num_threads(prev)
    model.save_pretrained(str(paths["model"]))
    (root / "sft.json").write_text(json.dumps(summary))
    (root / "done").write_text("ok\n")
    return paths
