"""The plug-in reward contract (`actor.verifier.function = "package.module:function"`).

A reward function has the signature

    score(response: str, gold: str, row: dict) -> float   # a real number in [0, 1]

`response` is the completion's answer region (the text after "</think>" when
`actor.verifier.require_think` is on, else the whole completion), `gold` the question's ground truth,
`row` what the actor knows about the question (see `ROW_KEYS`). It runs in the actors' verifier worker
processes (actors/verifier.py), with the same deadline and memory cap as math-verify.

This module holds the parts every process shares:
- `check_spec`: the "module:function" form, checked when the config loads;
- `load_reward_function`: the import, done once by the launcher at `train` start, by each actor before
  any work and by each verifier worker before it reports ready; a typo fails there, naming the spec.
  The module is looked up on `sys.path` and then in the current working directory, so a module next to
  where `exgrpo-async train` was started resolves the same in the launcher (a console script, whose
  path does not hold the working directory) and in its actors (`python -m`, whose path does);
- `call_reward_function`: one call, with the return value checked. A raise or a value that is not a
  real number in [0, 1] (a bool, None, a string, NaN, 1.5, ...) is a fault: reward 0, status "error";
- `FaultLog`: faults summed into at most one warning per interval, never one line per item.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("exgrpo_async.verifier")

RewardFunction = Callable[[str, str, dict], float]
# What `row` holds: the question's index in its pool, its data_source (else the file stem), the gold,
# the rendered prompt, and "train" or "eval".
ROW_KEYS = ("question_id", "data_source", "answer", "prompt", "purpose")
_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_EXAMPLE_CHARS = 160


class RewardFunctionError(ValueError):
    """A reward function spec that cannot be used: bad form, module not importable, no such callable."""


def check_spec(spec: str) -> str:
    """`spec` if it has the form "package.module:function", else ValueError saying so."""
    if not _SPEC.fullmatch(spec):
        raise ValueError(f"{spec!r} is not of the form 'package.module:function' "
                         "(e.g. 'exgrpo_async.rewards:exact_match')")
    return spec


def load_reward_function(spec: str) -> RewardFunction:
    """Import and return the function `spec` names; RewardFunctionError naming the spec otherwise."""
    try:
        check_spec(spec)
    except ValueError as e:
        raise RewardFunctionError(f"actor.verifier.function: {e}") from None
    module_name, attr = spec.split(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after everything installed: a local module never shadows a package
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raised while it ran
        raise RewardFunctionError(f"actor.verifier.function = {spec!r}: cannot import module {module_name!r} "
                                  f"({type(e).__name__}: {e})") from e
    if not hasattr(module, attr):
        raise RewardFunctionError(f"actor.verifier.function = {spec!r}: module {module_name!r} "
                                  f"({getattr(module, '__file__', '?')}) has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardFunctionError(f"actor.verifier.function = {spec!r}: {attr!r} is a {type(fn).__name__}, "
                                  "not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: the first call will tell
        return fn
    try:
        sig.bind("response", "gold", {})
    except TypeError as e:
        raise RewardFunctionError(f"actor.verifier.function = {spec!r}: cannot be called as "
                                  f"{attr}(response, gold, row) ({e}); signature {attr}{sig}") from None
    return fn


def _short(text: str) -> str:
    return text if len(text) <= _EXAMPLE_CHARS else text[:_EXAMPLE_CHARS - 3] + "..."


def check_reward(value: Any) -> tuple[float, tuple[str, str] | None]:
    """(reward, None) for a real number in [0, 1]; (0.0, (fault kind, example)) for anything else.

    A bool is refused like everywhere in the wire schema: `return 1.0 if ok else 0.0`, not `return ok`.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return 0.0, (f"returned {type(value).__name__}", _short(repr(value)))
    reward = float(value)
    if math.isnan(reward) or math.isinf(reward):
        return 0.0, ("returned a non-finite number", repr(reward))
    if not 0.0 <= reward <= 1.0:
        return 0.0, ("returned a number outside [0, 1]", repr(reward))
    return reward, None


def call_reward_function(fn: RewardFunction, response: str, gold: str,
                         row: dict) -> tuple[float, tuple[str, str] | None]:
    """`fn(response, gold, row)` checked by `check_reward`; a raise is the fault ("raised <type>", message)."""
    try:
        value = fn(response, gold, row)
    except Exception as e:  # the user's code: its fault costs this item only
        return 0.0, (f"raised {type(e).__name__}", _short(f"{type(e).__name__}: {e}"))
    try:
        return check_reward(value)
    except Exception as e:  # a numbers.Real whose float() itself raises
        return 0.0, (f"returned {type(value).__name__}", _short(f"float() raised {type(e).__name__}: {e}"))


class FaultLog:
    """Reward function faults summed per kind; `flush` logs one warning at most every `interval_s`
    (the first fault at once), with a count and the first example of each kind."""

    def __init__(self, spec: str, interval_s: float = 60.0):
        self.spec = spec
        self.interval_s = interval_s
        self.total = 0
        self._pending: dict[str, list] = {}  # kind -> [count, first example]
        self._next_at = 0.0

    def add(self, fault: tuple[str, str]) -> None:
        kind, example = fault
        self.total += 1
        self._pending.setdefault(kind, [0, example])[0] += 1

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._pending or (now < self._next_at and not force):
            return
        n = sum(count for count, _ in self._pending.values())
        kinds = "; ".join(f"{count}x {kind} (e.g. {example})" for kind, (count, example) in self._pending.items())
        log.warning("actor.verifier.function %s: %d item(s) scored 0 with status error since the last report "
                    "(it must return a real number in [0, 1]): %s", self.spec, n, kinds)
        self._pending.clear()
        self._next_at = now + self.interval_s
