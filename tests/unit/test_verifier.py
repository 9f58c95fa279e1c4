"""Reward verifier: the scoring rule (cases from shared/docs/verifier.md) and the process pool's
deadline / crash handling."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from actors.verifier import MathVerifier, normalize_gold, score_answer

GSM8K_GOLD = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18"
)

# (completion, gold, expected reward) with require_think=False
PLAIN_CASES = [
    ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "1/2", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("The total is \\boxed{1,000}.", "1000", 1.0),
    ("\\boxed{25}", "025", 1.0),  # AIME golds are zero-padded
    ("\\boxed{336}", "336^\\circ", 1.0),  # AIME25 #20
    ("\\boxed{27}", "27.0", 1.0),  # AMC golds are floats
    ("\\boxed{43}", "42", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("First \\boxed{5} is wrong. Rechecking gives \\boxed{3}.", "3", 1.0),  # the last box wins
    ("First \\boxed{5} is wrong. Rechecking gives \\boxed{3}.", "5", 0.0),
    # ...unless the boxes are close (<10 chars apart, or <70 with ",", ";", "and", "or"): then all of them
    # form one set answer (math-verify 0.9.0 multi-answer rule), so a hedged "5, 3" matches neither.
    ("\\boxed{5}, \\boxed{3}", "3", 0.0),
    ("\\boxed{5}, \\boxed{3}", "3, 5", 1.0),
    ("", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("I don't know.", "5", 0.0),
    ("The answer is \\boxed{18}.", GSM8K_GOLD, 1.0),  # GSM8K: gold after "####"
    ("The answer is \\boxed{9}.", GSM8K_GOLD, 0.0),
    ("$E = \\boxed{4.5\\times10^{33}}$ erg", "4.5e33", 1.0),  # Minerva sci-notation gold
    ("\\boxed{4.5 \\times 10^{33}}", "4.5e33", 1.0),
    ("\\boxed{4.6\\times10^{33}}", "4.5e33", 0.0),
    ("\\boxed{1.2\\times10^{-5}}", "1.2e-5", 1.0),
    ("<think>\\boxed{5}</think>", "5", 1.0),  # require_think off: think tags are ordinary text
]

# (completion, gold, expected reward) with require_think=True; the prompt already opened "<think>\n"
THINK_CASES = [
    ("Let me compute... \\boxed{5}", "5", 0.0),  # no "</think>": format error
    ("Let me compute 2+3.</think>The answer is \\boxed{5}.", "5", 1.0),
    ("Let me compute 2+3.</think>The answer is \\boxed{6}.", "5", 0.0),
    ("So it is \\boxed{5}.</think>Hence the result follows.", "5", 0.0),  # box only inside think
    ("hmm</think>\\boxed{5}</think>\\boxed{7}", "5", 1.0),  # between first and next "</think>"
    ("hmm</think>\\boxed{5}</think>\\boxed{7}", "7", 0.0),
    ("</think>", "5", 0.0),
]


@pytest.mark.parametrize("text,gold,expected", PLAIN_CASES)
def test_score_answer_plain(text: str, gold: str, expected: float) -> None:
    assert score_answer(text, gold, require_think=False) == expected


@pytest.mark.parametrize("text,gold,expected", THINK_CASES)
def test_score_answer_require_think(text: str, gold: str, expected: float) -> None:
    assert score_answer(text, gold, require_think=True) == expected


def test_normalize_gold() -> None:
    assert normalize_gold(GSM8K_GOLD) == "18"
    assert normalize_gold("4.5e33") == "4.5 \\times 10^{33}"
    assert normalize_gold("3e-7") == "3 \\times 10^{-7}"
    assert normalize_gold(" \\frac{1}{2} ") == "\\frac{1}{2}"
    assert normalize_gold("e^{2}") == "e^{2}"  # Euler's e is left alone


NORMAL = [("\\boxed{\\frac12}", "0.5"), ("\\boxed{43}", "42"), ("\\boxed{7}", "7")]
NORMAL_EXPECTED = [(1.0, "ok"), (0.0, "ok"), (1.0, "ok")]
TOWER = ("\\boxed{9^{9^{9^{9}}}}", "1")  # math-verify's own 5 s alarm would stop it; the pool's comes first


def _wait_dead(pid: int, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A killed child stays a zombie until its parent reaps it; read its state from /proc.
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still alive")


def test_pool_scores_in_order() -> None:
    with MathVerifier(workers=2, timeout_s=10, require_think=True, memory_limit_mb=2048) as v:
        items = [("ok</think>\\boxed{%d}" % i, str(i if i % 3 else i + 1)) for i in range(12)]
        results = v.score(items)
        assert results == [(0.0 if i % 3 == 0 else 1.0, "ok") for i in range(12)]
        assert v.score([]) == []
        assert v.calls == 12 and v.timeouts == 0 and v.errors == 0 and v.seconds_total > 0


def test_pool_adversarial_batch_is_bounded() -> None:
    with MathVerifier(workers=2, timeout_s=3, require_think=False, memory_limit_mb=2048) as v:
        v.score(NORMAL[:1])  # let the workers finish importing, so the bound below measures scoring
        t0 = time.monotonic()
        results = v.score([NORMAL[0], TOWER, NORMAL[1], NORMAL[2]])
        elapsed = time.monotonic() - t0
        assert elapsed < 20, elapsed
        assert [results[0], results[2], results[3]] == NORMAL_EXPECTED
        assert results[1][0] == 0.0 and results[1][1] in ("timeout", "ok")


def test_pool_deadline_kills_and_replaces_worker() -> None:
    with MathVerifier(workers=2, timeout_s=1, require_think=False, memory_limit_mb=2048) as v:
        v.score(NORMAL[:2])
        pids_before = set(v.worker_pids())
        t0 = time.monotonic()
        results = v.score([TOWER] + NORMAL)
        assert time.monotonic() - t0 < 10
        assert results[0] == (0.0, "timeout")
        assert results[1:] == NORMAL_EXPECTED
        assert v.timeouts >= 1 and v.errors == 0
        assert set(v.worker_pids()) != pids_before  # the hung worker was replaced
        # The replacement imports first; its first item is not charged for that.
        assert v.score(NORMAL * 2) == NORMAL_EXPECTED * 2
        assert len(v.worker_pids()) == 2


def test_pool_replaces_worker_killed_from_outside() -> None:
    with MathVerifier(workers=2, timeout_s=5, require_think=False, memory_limit_mb=2048) as v:
        assert v.score(NORMAL) == NORMAL_EXPECTED
        victim = v.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        _wait_dead(victim)
        assert v.score(NORMAL * 2) == NORMAL_EXPECTED * 2
        assert victim not in v.worker_pids() and len(v.worker_pids()) == 2
        assert v.timeouts == 0


def test_pool_worker_dying_mid_item_is_an_error() -> None:
    with MathVerifier(workers=1, timeout_s=10, require_think=False, memory_limit_mb=2048) as v:
        v.score(NORMAL[:1])
        victim = v.worker_pids()[0]
        # The tower keeps the worker busy for ~5 s (math-verify's alarm); kill it 1 s in.
        killer = threading.Timer(1.0, os.kill, args=(victim, signal.SIGKILL))
        killer.start()
        try:
            results = v.score([TOWER])
        finally:
            killer.join()
        assert results == [(0.0, "error")]
        assert v.errors == 1 and v.timeouts == 0
        assert v.score(NORMAL) == NORMAL_EXPECTED
        assert victim not in v.worker_pids()


def test_close_is_idempotent_and_stops_workers() -> None:
    v = MathVerifier(workers=2, timeout_s=5, require_think=False, memory_limit_mb=2048)
    pids = v.worker_pids()
    v.close()
    v.close()
    for pid in pids:
        _wait_dead(pid, timeout_s=2)
    with pytest.raises(RuntimeError):
        v.score(NORMAL)


FAST_CASES = [
    ("50+60=110,\\boxed{110}<eos>", "110", False),
    ("\\boxed{-7}", "-7", False),
    ("\\boxed{025}", "25", False),
    ("\\boxed{ 42 }", "42", False),
    ("\\boxed{43}", "42", False),
    ("so \\boxed{5}, but \\boxed{3}", "3", False),      # two boxes: math-verify decides (set answer)
    ("\\boxed{1,000}", "1000", False),                 # not a plain int: math-verify decides
    ("\\boxed{\\frac{1}{2}}", "1", False),
    ("\\boxed{12}", "\\frac{24}{2}", False),           # gold not an int: math-verify decides
    ("no box, answer is 12", "12", False),
    ("x</think> \\boxed{9}", "9", True),
    ("\\boxed{9} with no think end", "9", True),
    ("x #### 18", "#### 18", False),
]


@pytest.mark.parametrize("text, gold, think", FAST_CASES)
def test_fast_integer_path_agrees_with_math_verify(text, gold, think):
    from actors.verifier import fast_integer_score

    fast = fast_integer_score(text, gold, think)
    if fast is not None:
        assert fast == score_answer(text, gold, think)


def test_fast_integer_path_is_taken_for_plain_integer_boxes():
    from actors.verifier import fast_integer_score

    assert fast_integer_score("\\boxed{110}", "110", False) == 1.0
    assert fast_integer_score("\\boxed{111}", "110", False) == 0.0
    assert fast_integer_score("\\boxed{5}, \\boxed{3}", "3", False) is None
    assert fast_integer_score("\\boxed{9}", "9", True) == 0.0  # required </think> missing
