"""Reward functions for the tests of `actor.verifier.function` (tests/unit/test_verifier.py and
tests/integration/test_custom_reward.py); each runs in a verifier worker process, as a user's would."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time

from exgrpo_async.rewards import exact_match

NOT_CALLABLE = 0.5
PROBE_LOG_ENV = "EXGRPO_TEST_REWARD_LOG"

# what `junk` returns for each response text
JUNK = {"none": None, "str": "0.5", "nan": math.nan, "inf": math.inf, "big": 1.5, "neg": -0.25, "bool": True,
        "list": [1.0]}
VALID = {"int1": 1, "int0": 0, "quarter": 0.25}


def quarter(response: str, gold: str, row: dict) -> float:
    """0.25 whatever the response: a value math-verify never gives."""
    return 0.25


def length(response: str, gold: str, row: dict) -> float:
    """len(response) / 100: shows which part of the completion the function saw."""
    return len(response) / 100


def by_row(response: str, gold: str, row: dict) -> float:
    """question_id / 10 when the row carries every documented key with gold as its answer, else 0.9."""
    complete = set(row) == {"question_id", "data_source", "answer", "prompt", "purpose"} and row["answer"] == gold
    return row["question_id"] / 10 if complete else 0.9


def raises(response: str, gold: str, row: dict) -> float:
    raise ValueError(f"boom on {response!r}")


def hangs(response: str, gold: str, row: dict) -> float:
    """Hangs on "hang", else 1.0."""
    if response == "hang":
        time.sleep(3600)
    return 1.0


def junk(response: str, gold: str, row: dict):
    """JUNK[response] or VALID[response]: a return value of the wrong kind or range, or a right one."""
    return JUNK[response] if response in JUNK else VALID[response]


def one_arg(response: str) -> float:
    return 1.0


def graded_exact_match(response: str, gold: str, row: dict) -> float:
    """0.25 + 0.5 * exact_match (0.25 wrong, 0.75 right: never a math-verify reward), each call logged as a
    JSON line {pid, row, reward} to the file named by $EXGRPO_TEST_REWARD_LOG."""
    reward = 0.25 + 0.5 * exact_match(response, gold, row)
    with open(os.environ[PROBE_LOG_ENV], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "row": row, "reward": reward}) + "\n")
    return reward


def slow_on_some(response: str, gold: str, row: dict) -> float:
    """graded_exact_match, but a training question whose id is a multiple of 8 sleeps 30 s first (past
    any test's verifier deadline); such a call is logged before it sleeps, with reward null."""
    if row["purpose"] == "train" and row["question_id"] % 8 == 0:
        with open(os.environ[PROBE_LOG_ENV], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "row": row, "reward": None}) + "\n")
        time.sleep(30)
    return graded_exact_match(response, gold, row)


def __getattr__(name: str):
    """`worker_only_missing` exists in the test process but not in a verifier worker (named "verifier")."""
    if name == "worker_only_missing" and multiprocessing.current_process().name != "verifier":
        return quarter
    raise AttributeError(name)
