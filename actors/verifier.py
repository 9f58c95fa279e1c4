"""Reward verifier (seam 4 of 5): scores each completion against its gold answer with math-verify, 1.0 or
0.0, or with the user's reward function (`actor.verifier.function`, contract in exgrpo_async/custom_reward.py).

`score_answer` is the pure rule (ExGRPO's: answer after "</think>", then
`verify(parse("$" + gold + "$"), parse(pred))`). `MathVerifier` runs it in a small spawn-based pool of
worker processes, because math-verify's own timeouts are SIGALRM-based and only work in a process's
main thread; run in a thread without them, one power tower (an answer like 9^9^9^9) froze the whole
interpreter. On top of those, the pool enforces a hard wall-clock deadline per
item by killing the worker; a timeout or a worker crash scores 0.

A custom reward function runs in the same pool instead of math-verify: each worker imports it before it
reports ready (the actor imports it first, so a bad spec fails in the constructor, naming it). It gets
the answer region (`extract_response`; a missing required "</think>" scores 0 without a call), the gold
and a row (`score(..., rows=)`); a raise or a return value that is not a real number in [0, 1] scores 0
with status "error", counted in `errors` and logged in aggregate (`FaultLog`). The integer fast path is
math-verify's shortcut and is not taken for a custom function.

Interface:
    MathVerifier(workers, timeout_s, require_think, memory_limit_mb, function=None)
    score([(completion_text, gold), ...], rows=None) -> [(reward, status), ...]   status: "ok" | "timeout" | "error"
    timeouts, errors, calls (items scored), fast_path (items decided without a worker), seconds_total
    close()   (also a context manager)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import resource
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from exgrpo_async.custom_reward import FaultLog, RewardFunctionError, call_reward_function, load_reward_function
from exgrpo_async.startup import without_gc

# Minerva golds such as "4.5e33": math-verify reads them as 4.5*e*33 (Euler's e), so spell the power out.
_SCI_NOTATION = re.compile(r"(\d)e\+?(-?\d+)")
_READY = "ready"
# A fresh worker imports sympy + math-verify (~0.5-2 s); this only bounds a start that never finishes.
_START_TIMEOUT_S = 120.0
_MAX_FAILED_STARTS = 3


def normalize_gold(gold: str) -> str:
    """Gold answer as math-verify should see it (without the surrounding `$`)."""
    if "####" in gold:  # GSM8K: the answer is after "####"; the CoT before it would be mis-extracted
        gold = gold.split("####", 1)[1]
    return _SCI_NOTATION.sub(r"\1 \\times 10^{\2}", gold.strip())


def extract_response(text: str, require_think: bool) -> str | None:
    """The part of a completion that may hold the answer; None when the required "</think>" is missing."""
    if not require_think:
        return text
    # ExGRPO's template opens "<think>\n" in the prompt, so the completion starts inside the think block.
    text = "<think>\n" + text
    if "</think>" not in text:
        return None
    return text.split("</think>")[1]  # between the first "</think>" and the next one (or the end)


def score_answer(text: str, gold: str, require_think: bool) -> float:
    """1.0 if the completion's final answer equals `gold`, else 0.0. Runs in a verifier worker.

    Uses math-verify's default per-step timeouts (5 s), which work only in a main thread.
    """
    response = extract_response(text, require_think)
    if response is None:
        return 0.0
    try:
        from math_verify import parse, verify  # lazy: keeps sympy out of the actor process itself

        gold_parsed = parse("$" + normalize_gold(gold) + "$")
        pred_parsed = parse(response)
        return 1.0 if verify(gold_parsed, pred_parsed) else 0.0
    except Exception:  # a parser/sympy failure (or MemoryError under RLIMIT_AS) is a wrong answer
        return 0.0


_INT = re.compile(r"-?\d{1,100}")  # bounded: Python refuses int() of >4300 digits


def fast_integer_score(text: str, gold: str, require_think: bool) -> float | None:
    """The verdict without math-verify when it is certain, else None (then math-verify decides).

    Certain cases: the required "</think>" is missing (0.0), or the answer region holds exactly one
    `\\boxed{INT}` and the gold is an integer (math-verify would compare the same two integers; two or
    more boxes can merge into a set answer there, so they go to math-verify). Skips ~0.6 ms of parsing
    per completion on integer-answer tasks.
    """
    response = extract_response(text, require_think)
    if response is None:
        return 0.0
    g = normalize_gold(gold)
    if not _INT.fullmatch(g) or response.count("\\boxed") != 1:
        return None
    start = response.find("\\boxed{")
    end = response.find("}", start)
    if start < 0 or end < 0:
        return None
    content = response[start + len("\\boxed{"):end].strip()
    if not _INT.fullmatch(content):
        return None
    return 1.0 if int(content) == int(g) else 0.0


def _worker_main(conn: Connection, memory_limit_mb: int, function: str | None = None) -> None:
    """Worker loop, run in the worker's main thread: (text, gold, require_think, row) in, (reward, fault) out,
    fault None or (kind, example) when the custom `function` raised or returned junk."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from exgrpo_async.logs import setup_logging

    setup_logging("verifier", str(os.getpid()), level=logging.WARNING)  # math-verify's warnings, in the run's format
    if memory_limit_mb > 0:
        # Address-space cap: `2^{10^9}`-style inputs should fail with MemoryError here, not swap the host.
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with without_gc():  # the function's or math-verify's imports (exgrpo_async/startup.py)
        try:
            fn = load_reward_function(function) if function else None
        except RewardFunctionError as e:
            conn.send(str(e))  # instead of _READY: the parent names it when it gives up starting workers
            return
        if fn is None:
            score_answer("\\boxed{1}", "1", False)  # import + antlr warm-up (~0.6 s) before any deadline runs
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent closed its end or died: nothing left to do
            return
        if msg is None:
            return
        text, gold, require_think, row = msg
        if fn is None:
            conn.send((score_answer(text, gold, require_think), None))
            continue
        response = extract_response(text, require_think)
        conn.send((0.0, None) if response is None else call_reward_function(fn, response, gold, row))


class _Worker:
    def __init__(self, ctx: mp.context.SpawnContext, memory_limit_mb: int, function: str | None):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc: BaseProcess = ctx.Process(
            target=_worker_main, args=(child_conn, memory_limit_mb, function), name="verifier", daemon=True
        )
        self.proc.start()
        child_conn.close()  # only the child holds its end, so its death reads as EOF here
        self.ready = False
        self.started = time.monotonic()

    def stop(self) -> None:
        """Kill without asking: a hung worker may be deep in big-int arithmetic."""
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


class MathVerifier:
    """Spawn-based pool of math-verify (or custom reward `function`) workers with a hard per-item deadline."""

    def __init__(self, workers: int, timeout_s: float, require_think: bool, memory_limit_mb: int,
                 function: str | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if function is not None:
            load_reward_function(function)  # here, once: a bad spec fails before any worker starts
        self.function = function
        self._faults = FaultLog(function) if function is not None else None
        self.timeout_s = float(timeout_s)
        self.require_think = require_think
        self.memory_limit_mb = memory_limit_mb
        # spawn, never fork: the actor holds CUDA/vLLM state that must not be copied into a child.
        self._ctx = mp.get_context("spawn")
        self.timeouts = 0
        self.errors = 0
        self.calls = 0
        self.fast_path = 0  # items decided without a worker (fast_integer_score, or a missing "</think>")
        self.seconds_total = 0.0
        self.last_latencies: list[float] = []  # seconds per item of the latest score() call
        self._failed_starts = 0
        self._closed = False
        # Processes start now; they import in the background while the actor loads its model.
        self._workers = [_Worker(self._ctx, memory_limit_mb, function) for _ in range(workers)]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop()
        fresh = _Worker(self._ctx, self.memory_limit_mb, self.function)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _start_failed(self, worker: _Worker, why: str) -> _Worker:
        # A worker that cannot even import (broken env) would otherwise be restarted forever.
        self._failed_starts += 1
        if self._failed_starts > _MAX_FAILED_STARTS:
            raise RuntimeError(f"verifier workers fail to start ({why}); see their stderr")
        return self._replace(worker)

    def score(self, items: list[tuple[str, str]], rows: list[dict] | None = None) -> list[tuple[float, str]]:
        """(reward, status) for each (completion_text, gold), in order; status "ok", "timeout" or "error".
        `rows[i]` (question_id, data_source, prompt, purpose) is what a custom function gets with item i,
        its "answer" set to item i's gold; math-verify ignores rows."""
        if self._closed:
            raise RuntimeError("MathVerifier is closed")
        if rows is not None and len(rows) != len(items):
            raise ValueError(f"{len(rows)} rows for {len(items)} items")
        t0 = time.monotonic()
        results: list[tuple[float, str]] = [(0.0, "error")] * len(items)
        latencies = [0.0] * len(items)  # per item: fast path, or from hand-off to reply / deadline / crash
        pending = deque()
        for i, (text, gold) in enumerate(items):
            t_item = time.perf_counter()
            if self.function is None:
                fast = fast_integer_score(text, gold, self.require_think)
            else:  # a custom function is never second-guessed; only the format rule is decided here
                fast = 0.0 if extract_response(text, self.require_think) is None else None
            if fast is None:
                pending.append(i)
            else:
                results[i] = (fast, "ok")
                latencies[i] = time.perf_counter() - t_item
                self.fast_path += 1
        busy: dict[Connection, tuple[_Worker, int, float]] = {}  # conn -> (worker, item index, deadline)
        while pending or busy:
            # Hand items to ready, idle, live workers.
            for w in list(self._workers):
                if not pending:
                    break
                if not w.ready or w.conn in busy:
                    continue
                if not w.proc.is_alive():  # died while idle (e.g. killed from outside): no item is lost
                    self._replace(w)
                    continue
                i = pending[0]
                text, gold = items[i]
                row = None if self.function is None else {**(rows[i] if rows is not None else {}), "answer": gold}
                try:
                    w.conn.send((text, gold, self.require_think, row))
                except (BrokenPipeError, EOFError, OSError):
                    self._replace(w)  # the item never reached a worker: keep it pending
                    continue
                pending.popleft()
                busy[w.conn] = (w, i, time.monotonic() + self.timeout_s)
                latencies[i] = time.perf_counter()
            # Wait for a reply, a dying worker, a starting worker's readiness, or the nearest deadline.
            starting = [w for w in self._workers if not w.ready]
            now = time.monotonic()
            deadlines = [d for _, _, d in busy.values()] + [w.started + _START_TIMEOUT_S for w in starting]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready = wait(list(busy) + [w.conn for w in starting], timeout)
            for conn in ready:
                if conn in busy:
                    w, i, _ = busy.pop(conn)
                    latencies[i] = time.perf_counter() - latencies[i]
                    try:
                        reward, fault = conn.recv()
                    except (EOFError, OSError):  # crashed on this item (segfault, OOM kill, ...)
                        results[i] = (0.0, "error")
                        self.errors += 1
                        self._replace(w)
                        continue
                    if fault is None:
                        results[i] = (float(reward), "ok")
                    else:  # the custom function raised or returned junk: this item's fault only
                        results[i] = (0.0, "error")
                        self.errors += 1
                        self._faults.add(fault)
                else:
                    w = next(w for w in self._workers if w.conn is conn)
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        self._start_failed(w, "died while importing")
                        continue
                    if msg == _READY:
                        w.ready = True
                        self._failed_starts = 0
                    else:  # the reward function failed to import in the worker
                        self._start_failed(w, str(msg))
            now = time.monotonic()
            for conn, (w, i, deadline) in list(busy.items()):
                if now >= deadline and not conn.poll(0):  # a reply that just arrived still counts
                    del busy[conn]
                    latencies[i] = time.perf_counter() - latencies[i]
                    results[i] = (0.0, "timeout")
                    self.timeouts += 1
                    self._replace(w)
            for w in [w for w in self._workers if not w.ready and now >= w.started + _START_TIMEOUT_S]:
                self._start_failed(w, f"not ready after {_START_TIMEOUT_S:.0f} s")
        self.calls += len(items)
        self.seconds_total += time.monotonic() - t0
        self.last_latencies = latencies
        if self._faults is not None:
            self._faults.flush()
        return results

    def close(self) -> None:
        """Stop all workers; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._faults is not None:
            self._faults.flush(force=True)
        for w in self._workers:
            try:
                w.conn.send(None)  # polite exit first; a worker that is stuck gets killed below
            except (BrokenPipeError, EOFError, OSError):
                pass
        grace = time.monotonic() + 1.0
        for w in self._workers:
            w.proc.join(timeout=max(0.0, grace - time.monotonic()))
            w.stop()
        self._workers = []

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """Worker process ids (for monitoring and tests)."""
        return [w.proc.pid for w in self._workers if w.proc.pid is not None]
