"""Ready-made reward functions for `actor.verifier.function` (the contract: exgrpo_async/custom_reward.py).

`exact_match` is a string reward that runs no math parser and no code: the final answer (the content
of the last `\\boxed{...}`, else the last number in the response) must equal the gold after
normalisation (whitespace, `$`, `\\!`/`\\,` spacing and thousands commas dropped; a plain decimal
number written canonically, so "025", "25.0" and "1,000" read as 25, 25 and 1000). It does not know
that 1/2 = 0.5 or `\\frac{1}{2}` = 1/2: for mathematical equivalence keep the default (math-verify).

Run it on the toy task (a CPU demo, a few minutes on 2 cores):

    exgrpo-async train learner.max_steps=20 actor.verifier.function=exgrpo_async.rewards:exact_match

Your own function is any importable `module:function` with the same signature, e.g. `my_rewards.py`
in the folder `exgrpo-async train` starts from, as `actor.verifier.function=my_rewards:score`.
"""

from __future__ import annotations

import re
from decimal import Decimal

from exgrpo_async.data import extract_last_boxed

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # "1,000" is one number; "1,2" are two
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DROP = re.compile(r"\s+|\$|\\[!,;]")


def normalize_answer(text: str) -> str:
    """`text` without spacing, `$` and thousands commas; a plain decimal number in canonical form."""
    text = _DROP.sub("", text)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    text = text.rstrip(".")
    if _PLAIN_NUMBER.fullmatch(text) and len(text) <= 100:
        value = Decimal(text).normalize()
        text = f"{value:f}"
        if text == "-0":
            text = "0"
    return text


def final_answer(response: str) -> str | None:
    """The content of the last `\\boxed{...}`, else the last number, else None."""
    boxed = extract_last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def exact_match(response: str, gold: str, row: dict) -> float:
    """1.0 if the response's final answer equals `gold` after `normalize_answer`, else 0.0. A GSM8K gold
    ("... #### 18") is read after its "####"; `row` is not used."""
    answer = final_answer(response)
    if answer is None:
        return 0.0
    if "####" in gold:
        gold = gold.split("####", 1)[1]
    return 1.0 if normalize_answer(answer) == normalize_answer(gold) else 0.0
