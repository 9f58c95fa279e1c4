"""Job: load math question files (JSONL, JSON array, parquet) into one pool of `Question`s with a string
ground truth, render a question as a prompt, and hand out question ids epoch by epoch.

Row formats, tried in order: verl (`prompt` a list of {role, content} plus `reward_model.ground_truth`;
ExGRPO/LUFFY, One-Shot-RLVR); plain (`problem`/`question` + `answer`/`final_answer`); Qwen minerva_math
(no answer field: the last \\boxed{...} of `solution`). Answers: a `final_answer` list (OlympiadBench) is
joined with ", "; an `answer` list or stringified list of strings (rllm Minerva) holds alternatives, the
first kept and the rest in meta["alt_answers"]; GSM8K "CoT #### N" keeps N (digit-group commas dropped);
numbers become strings, integral floats without ".0" (27.0 -> "27"). A bad row raises DataError naming
file and 1-based row (and line, for JSONL); with skip_bad_rows=True it is logged and listed instead.
`check_file` reads only a file's first rows the same way (exgrpo_async/launcher/preflight.py, before a run starts).
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

logger = logging.getLogger("exgrpo_async.data")

_META_KEYS = ("kind", "level", "subject", "type", "subfield", "difficulty", "unique_id", "id", "idx", "year",
              "answer_type", "ability")


class DataError(ValueError):
    """A question file or row that cannot be used; the message names the file and row."""


@dataclass
class Question:
    qid: int                          # index in the loaded pool, 0..N-1 over all files in order
    problem: str                      # question text; "" when `messages` carries the prompt
    messages: list[dict] | None       # verl rows: the chat messages [{role, content}, ...]
    answer: str                       # ground truth
    source: str                       # data_source, else the file stem (parent/stem for test.jsonl etc.)
    meta: dict = field(default_factory=dict)


@dataclass
class QuestionPool:
    questions: list[Question]
    skipped: list[str]                # "file: row N: reason" for each bad row left out (skip_bad_rows=True)


# ----------------------------------------------------------------------------- row parsing
def extract_last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text` (nested braces matched), or None."""
    start, depth = ([m.end() for m in re.finditer(r"\\boxed\s*\{", text)] or [len(text)])[-1], 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _answer_text(value: Any, key: str, meta: dict) -> str:
    if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, list) and parsed and all(isinstance(v, str) for v in parsed):
            value = parsed  # rllm style "['4.5e33']"; a list of numbers such as "[1, 2]" is an interval
    if isinstance(value, list):
        items = [_answer_text(v, key, meta) for v in value]
        if not items:
            raise DataError(f"empty answer list in `{key}`")
        if key == "final_answer":
            return ", ".join(items)
        if len(items) > 1:
            meta["alt_answers"] = items[1:]
        return items[0]
    if value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"answer in `{key}` is {'null' if value is None else 'a ' + type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"answer in `{key}` is {value}")
        value = str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if "####" in text:  # GSM8K: chain of thought, then "#### N"
        text = text.split("####")[-1].strip()
        text = text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+", text) else text
    if not text:
        raise DataError(f"empty answer in `{key}`")
    return text


def _parse_row(row: Any) -> tuple[str, list[dict] | None, str, str | None, dict]:
    """(problem, messages, answer, data_source or None, meta) of one row, or DataError(reason)."""
    if not isinstance(row, dict):
        raise DataError(f"row is a {type(row).__name__}, not an object")
    meta = {k: row[k] for k in _META_KEYS
            if isinstance(row.get(k), (int, float, bool)) or (isinstance(row.get(k), str) and len(row[k]) <= 200)}
    source = row.get("data_source") if isinstance(row.get("data_source"), str) and row["data_source"] else None
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        reward = row.get("reward_model")
        if not isinstance(reward, dict) or "ground_truth" not in reward:
            raise DataError("verl-style `prompt` list but no reward_model.ground_truth")
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                 and isinstance(m.get("content"), str) for m in prompt):
            raise DataError("`prompt` is not a non-empty list of {role, content} messages")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if isinstance(row.get("extra_info"), dict) and isinstance(row["extra_info"].get("index"), int):
            meta["index"] = row["extra_info"]["index"]
        return "", messages, _answer_text(reward["ground_truth"], "reward_model.ground_truth", meta), source, meta
    problem = next((row[k] for k in ("problem", "question") if isinstance(row.get(k), str) and row[k].strip()), None)
    if problem is None:
        raise DataError("no question text (expected a non-empty `problem` or `question` string)")
    key = next((k for k in ("answer", "final_answer") if k in row), None)
    if key is not None:
        answer = _answer_text(row[key], key, meta)
    elif isinstance(row.get("solution"), str) and (boxed := extract_last_boxed(row["solution"])) is not None:
        answer = _answer_text(boxed, "solution \\boxed{}", meta)
    else:
        raise DataError("no answer (expected `answer`, `final_answer` or a \\boxed{} in `solution`)")
    return problem, None, answer, source, meta


# ----------------------------------------------------------------------------- files
def _iter_rows(path: Path, first: int | None = None) -> Iterator[tuple[str, Any]]:
    """(location, row) pairs; location reads "file: row N" (plus "(line L)" for JSONL). JSONL is read line
    by line; `first` (a row count) makes a parquet file read only its first batch of that many rows."""
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{path}: unknown file type {suffix or '(none)'!r}; expected .jsonl, .json or .parquet")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            row = 0
            for line_no, text in enumerate(f, 1):
                if not text.strip():
                    continue
                row += 1
                try:
                    obj: Any = json.loads(text.rstrip("\n"))
                except json.JSONDecodeError as e:  # handed on as the row, so skip_bad_rows can skip it
                    obj = DataError(f"invalid JSON ({e.msg} at column {e.colno})")
                yield f"{path}: row {row} (line {line_no})", obj
        return
    if suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON array of rows, got a {type(rows).__name__}")
    else:
        import pyarrow.parquet as pq
        if first is None:
            rows = pq.read_table(path).to_pylist()
        else:
            with pq.ParquetFile(path) as pf:
                batch = next(pf.iter_batches(batch_size=first), None)
            rows = batch.to_pylist() if batch is not None else []
    for i, obj in enumerate(rows, 1):
        yield f"{path}: row {i}", obj


def check_file(path: str | Path, rows: int = 20, skip_bad_rows: bool = False) -> int:
    """Read the first `rows` rows of `path` as `load_pool` reads them, and return how many are good.
    DataError (naming the file, and the row) for a file that cannot be read, a bad row among them
    (with skip_bad_rows, only when none of them is good), or a file without rows."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a file")
    good, seen, first_bad = 0, 0, None
    try:
        for where, row in itertools.islice(_iter_rows(path, first=rows), rows):
            seen += 1
            try:
                if isinstance(row, DataError):
                    raise row
                _parse_row(row)
                good += 1
            except DataError as e:
                if not skip_bad_rows:
                    raise DataError(f"{where}: {e}") from None
                first_bad = first_bad or f"{where.removeprefix(f'{path}: ')}: {e}"
    except DataError:
        raise
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except (OSError, ValueError) as e:  # unreadable; pyarrow's errors for a file that is not parquet
        raise DataError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not seen:
        raise DataError(f"{path}: no rows")
    if not good:
        raise DataError(f"{path}: none of the first {seen} rows is good (data.skip_bad_rows=true skips bad rows, "
                        f"not a whole file); {first_bad}")
    return good


def load_pool(paths: Sequence[str | Path], skip_bad_rows: bool = False) -> QuestionPool:
    """All questions of `paths`, in file and row order, numbered 0..N-1."""
    questions: list[Question] = []
    skipped: list[str] = []  # one "file: row N: reason" per bad row left out
    for p in paths:
        path = Path(p).expanduser()
        generic = path.stem in {"test", "train", "valid", "val", "dev"}  # qwen_eval/aime24/test.jsonl -> "aime24/test"
        default_source = f"{path.parent.name}/{path.stem}" if generic else path.stem
        for where, row in _iter_rows(path):
            try:
                if isinstance(row, DataError):
                    raise row
                problem, messages, answer, source, meta = _parse_row(row)
            except DataError as e:
                if not skip_bad_rows:
                    raise DataError(f"{where}: {e}") from None
                skipped.append(f"{where}: {e}")
                logger.warning("skipping %s: %s", where, e)
                continue
            questions.append(Question(len(questions), problem, messages, answer, source or default_source, meta))
    return QuestionPool(questions, skipped)


# ----------------------------------------------------------------------------- prompts
# The ExGRPO authors' template (their Qwen2.5-Math-7B-16k-think model's, used for every Qwen backbone):
# the system message, the question, and an assistant turn that opens the think block, so generation
# starts inside it and the reward looks for the answer after "</think>".
THINK_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}{{ ' User: This is the problem: ' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{{ ' Assistant: ' + m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' Assistant: <think>\n' }}{%- endif -%}"
)


def set_chat_template(tokenizer: Any, setting: str | None) -> None:
    """Apply `data.chat_template`: None keeps the tokenizer's own, "think" the authors' template, anything
    else is taken as a Jinja template."""
    if setting is not None:
        tokenizer.chat_template = THINK_CHAT_TEMPLATE if setting == "think" else setting


def render_prompt(q: Question, template: str, system_prompt: str | None, use_chat_template: bool,
                  tokenizer: Any) -> str:
    """The prompt for `q`. verl rows (q.messages) always use the chat template, `system_prompt` (if given)
    replacing their system message. Plain rows get `template.format(problem=...)`, then, if
    `use_chat_template`, the chat template with `system_prompt` first (it is unused otherwise)."""
    if q.messages is not None:
        messages = [dict(m) for m in q.messages]
        if system_prompt is not None:
            messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]
    else:
        try:
            text = template.format(problem=q.problem)
        except (KeyError, IndexError, ValueError) as e:
            raise DataError(f"prompt template {template!r} cannot be filled ({e!r}); it may use only "
                            "{problem}, and literal braces must be doubled, as in \\boxed{{}}") from e
        if not use_chat_template:
            return text
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages = system + [{"role": "user", "content": text}]
    if not getattr(tokenizer, "chat_template", None):
        need = "its row carries chat messages" if q.messages is not None else "use_chat_template is true"
        raise DataError(f"question {q.qid} ({q.source}) needs a chat template ({need}) but the tokenizer has none")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_limit(max_prompt_tokens: int, max_model_len: int, max_new_tokens: int) -> tuple[int, str]:
    """The longest prompt, in tokens, a question may have, and the setting that sets it: data.max_prompt_tokens,
    or what model.max_model_len leaves beside a whole completion when that is less (vLLM refuses a prompt
    past its context, failing the actor's whole request; a shorter one without room for max_new_tokens
    would have its completions cut short)."""
    room = max_model_len - max_new_tokens
    if room < max_prompt_tokens:
        return room, f"model.max_model_len={max_model_len} less rollout.max_new_tokens={max_new_tokens}"
    return max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"


def too_long(prompts: Sequence[str], tokenizer: Any, limit: int) -> set[int]:
    """Positions of the prompts longer than `limit` tokens, counted as the engines count them (one batched
    call: a fast tokenizer encodes the list in Rust, not prompt by prompt in Python)."""
    if not prompts:
        return set()
    return {i for i, ids in enumerate(tokenizer(list(prompts))["input_ids"]) if len(ids) > limit}


# ----------------------------------------------------------------------------- sampling
class QuestionSampler:
    """Shuffled epochs over question ids. Each epoch is a fresh permutation fixed by (seed, epoch);
    `exclude` (ExGRPO retirement) takes effect from the next epoch on."""

    def __init__(self, qids: Sequence[int], seed: int = 0) -> None:
        self._qids = list(dict.fromkeys(qids))
        if not self._qids:
            raise ValueError("QuestionSampler needs at least one question id")
        self.seed, self.epoch = seed, 0
        self._excluded: set[int] = set()   # left out of the current epoch; `_pending` from the next one on
        self._pending: set[int] = set()
        self._order, self._pos = self._make_order(), 0

    def _make_order(self) -> list[int]:
        order = [q for q in self._qids if q not in self._excluded]
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> int:
        """The next question id, starting a new shuffled epoch when this one is used up."""
        if self._pos >= len(self._order):
            self.epoch, self._excluded, self._pending = self.epoch + 1, self._excluded | self._pending, set()
            self._order, self._pos = self._make_order(), 0
            if not self._order:
                raise ValueError("QuestionSampler: every question id has been excluded")
        self._pos += 1
        return self._order[self._pos - 1]

    def exclude(self, qids: set[int]) -> None:
        """Leave `qids` out of every epoch after the current one."""
        if unknown := set(qids) - set(self._qids):
            raise ValueError(f"QuestionSampler.exclude: unknown question ids {sorted(unknown)[:10]}")
        self._pending |= set(qids) - self._excluded

    def include(self, qids) -> None:
        """Undo `exclude` for `qids` (ExGRPO's re-injection ablation), from the next epoch on."""
        qids = set(qids)
        self._pending -= qids
        self._excluded -= qids

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self._pos, "num_qids": len(self._qids),
                "excluded": sorted(self._excluded), "pending": sorted(self._pending)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_qids"] != len(self._qids):
            raise ValueError(f"sampler state is for {state['num_qids']} questions, this pool has {len(self._qids)}")
        self.seed, self.epoch = state["seed"], state["epoch"]
        self._excluded, self._pending = set(state["excluded"]), set(state["pending"])
        self._order, self._pos = self._make_order(), state["position"]
