"""Reward verifier: the scoring rule (cases from shared/docs/verifier.md), the process pool's
deadline / crash handling, and custom reward functions (`actor.verifier.function`) in that pool."""

from __future__ import annotations

import os
import re
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
        assert results[1] == (0.0, "timeout") and v.timeouts == 1  # the 3 s deadline, before math-verify's 5 s alarm


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


# ----------------------------------------------------------------------------- custom reward functions
# (actor.verifier.function; the functions are in tests/reward_fns.py and run in real verifier workers)
def _custom(name: str, timeout_s: float = 5, require_think: bool = False, workers: int = 1) -> MathVerifier:
    return MathVerifier(workers=workers, timeout_s=timeout_s, require_think=require_think, memory_limit_mb=2048,
                        function=f"tests.reward_fns:{name}")


def test_custom_function_scores_instead_of_math_verify() -> None:
    with _custom("quarter", workers=2) as v:
        # a plain integer box against an integer gold: math-verify's fast path would say 1.0 / 0.0
        results = v.score([("\\boxed{5}", "5"), ("\\boxed{6}", "5"), ("", "5")])
        assert results == [(0.25, "ok")] * 3
        assert v.fast_path == 0 and v.errors == 0 and v.calls == 3


def test_custom_function_gets_the_row_with_the_gold_as_answer() -> None:
    rows = [{"question_id": q, "data_source": "src", "prompt": "p", "purpose": "train"} for q in (3, 7)]
    with _custom("by_row") as v:
        assert v.score([("a", "1"), ("b", "2")], rows) == [(0.3, "ok"), (0.7, "ok")]
        with pytest.raises(ValueError, match="1 rows for 2 items"):
            v.score([("a", "1"), ("b", "2")], rows[:1])


def test_custom_function_sees_the_answer_region_and_never_a_missing_think() -> None:
    with _custom("length", require_think=True) as v:
        results = v.score([("reasoning</think>12345", "5"), ("no think end, 100 chars of answer", "5")])
        assert results == [(0.05, "ok"), (0.0, "ok")]  # "12345"; the second one scored 0 without a call
        assert v.fast_path == 1
    with _custom("length", require_think=False) as v:
        assert v.score([("reasoning</think>12345", "5")]) == [(0.22, "ok")]  # the whole completion


def test_custom_function_raising_is_a_counted_error_with_one_log_line(caplog) -> None:
    with caplog.at_level("WARNING", logger="exgrpo_async.verifier"):
        with _custom("raises") as v:
            assert v.score([("x", "1")] * 5) == [(0.0, "error")] * 5
            assert v.score([("y", "1")] * 3) == [(0.0, "error")] * 3  # within the interval: no new line yet
            assert v.errors == 8 and v.timeouts == 0
            assert v.score([("ok", "1")]) == [(0.0, "error")]
            pids = v.worker_pids()
            assert len(pids) == 1  # the worker survived every raise
    lines = [r.getMessage() for r in caplog.records if "tests.reward_fns:raises" in r.getMessage()]
    assert len(lines) == 2, lines  # the first report at once, the rest when the pool closed
    assert "5 item(s)" in lines[0] and "5x raised ValueError (e.g. ValueError: boom on 'x')" in lines[0]
    assert "4 item(s)" in lines[1] and "raised ValueError" in lines[1]


def test_custom_function_junk_returns_are_errors_naming_the_type(caplog) -> None:
    from tests.reward_fns import JUNK, VALID

    with caplog.at_level("WARNING", logger="exgrpo_async.verifier"):
        with _custom("junk", workers=2) as v:
            results = v.score([(k, "1") for k in [*JUNK, *VALID]])
            assert results[:len(JUNK)] == [(0.0, "error")] * len(JUNK)
            assert results[len(JUNK):] == [(1.0, "ok"), (0.0, "ok"), (0.25, "ok")]
            assert v.errors == len(JUNK) and v.timeouts == 0
    (line,) = [r.getMessage() for r in caplog.records if "tests.reward_fns:junk" in r.getMessage()]
    for kind in ("returned NoneType (e.g. None)", "returned str (e.g. '0.5')", "returned bool (e.g. True)",
                 "returned list"):
        assert kind in line, (kind, line)
    # two workers: which of a kind's two items is tallied first (its example) depends on completion order
    assert re.search(r"2x returned a non-finite number \(e\.g\. (nan|inf)\)", line), line
    assert re.search(r"2x returned a number outside \[0, 1\] \(e\.g\. (1\.5|-0\.25)\)", line), line


def test_custom_function_hanging_is_killed_at_the_deadline() -> None:
    with _custom("hangs", timeout_s=1, workers=2) as v:
        v.score([("warm", "1")] * 2)
        pids_before = set(v.worker_pids())
        t0 = time.monotonic()
        results = v.score([("hang", "1"), ("fine", "1"), ("fine", "1")])
        assert time.monotonic() - t0 < 5
        assert results == [(0.0, "timeout"), (1.0, "ok"), (1.0, "ok")]
        assert v.timeouts == 1 and v.errors == 0
        assert set(v.worker_pids()) != pids_before and len(v.worker_pids()) == 2  # the hung one replaced
        assert v.score([("fine", "1")] * 3) == [(1.0, "ok")] * 3


@pytest.mark.parametrize("spec, message", [
    ("tests.no_such_module:f", "cannot import module 'tests.no_such_module' (ModuleNotFoundError"),
    ("tests.reward_fns:nope", "tests/reward_fns.py) has no attribute 'nope'"),
    ("tests.reward_fns:NOT_CALLABLE", "'NOT_CALLABLE' is a float, not a function"),
    ("tests.reward_fns:one_arg", "cannot be called as one_arg(response, gold, row)"),
    ("tests.reward_fns.quarter", "is not of the form 'package.module:function'"),
])
def test_bad_spec_fails_at_construction_naming_it(spec: str, message: str) -> None:
    from exgrpo_async.custom_reward import RewardFunctionError

    with pytest.raises(RewardFunctionError, match=re.escape(message)) as e:
        MathVerifier(workers=1, timeout_s=5, require_think=False, memory_limit_mb=2048, function=spec)
    assert "actor.verifier.function" in str(e.value)
    if ":" in spec:
        assert repr(spec) in str(e.value)


def test_spec_failing_only_in_the_workers_stops_the_pool_with_its_reason() -> None:
    with _custom("worker_only_missing") as v:  # importable here, not in a worker
        with pytest.raises(RuntimeError, match="fail to start .*has no attribute 'worker_only_missing'"):
            v.score([("a", "1")])


def test_spec_is_checked_when_the_config_loads() -> None:
    from exgrpo_async.config_io import load_config

    cfg = load_config(None, ["actor.verifier.function=exgrpo_async.rewards:exact_match"])
    assert cfg.actor.verifier.function == "exgrpo_async.rewards:exact_match"
    assert load_config(None, ["actor.verifier.function=none"]).actor.verifier.function is None
    assert load_config(None).actor.verifier.function is None
    for bad in ("exgrpo_async.rewards.exact_match", "exgrpo_async/rewards.py:exact_match", "mod:fn:x", "''"):
        with pytest.raises(ValueError, match=r"actor\.verifier\.function: .*not of the form 'package\.module:"):
            load_config(None, [f"actor.verifier.function={bad}"])


@pytest.mark.parametrize("response, gold, expected", [
    ("so \\boxed{42}.", "42", 1.0),
    ("so \\boxed{43}.", "42", 0.0),
    ("first 7, then \\boxed{\\frac{1}{2}} and 9", "\\frac{1}{2}", 1.0),  # the box, not the last number
    ("\\boxed{025}", "25", 1.0),
    ("\\boxed{$1,000$}", "1000", 1.0),
    ("\\boxed{27.0}", "27", 1.0),
    ("the answer is 18.", "Janet... #### 18", 1.0),  # no box: the last number; GSM8K gold after ####
    ("about 1,250 apples", "1250", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 0.0),  # no math: string equality only
    ("no answer here", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
])
def test_exact_match_example_reward(response: str, gold: str, expected: float) -> None:
    from exgrpo_async.rewards import exact_match

    assert exact_match(response, gold, {}) == expected
