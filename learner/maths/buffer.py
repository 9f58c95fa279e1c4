"""ExGRPO's experience buffer: correct past trajectories per question, bucketed by success count.

A library piece: it knows nothing about processes, torch or the learner loop, so another trainer can
use it. Rules (docs/exgrpo.md, "Where each rule lives"; the authors' code as default):
- `record(qid, k, correct)` after a group of K was scored: 1 <= k <= K-1 stores the question in
  bucket k (last write wins) and appends its correct trajectories, de-duplicated by token ids;
  k == 0 changes nothing; k == K retires the question for good (`retire`).
- retired questions are excluded from sampling at once and leave the buffer at `end_step()`.
- `sample_questions(n, exclude=...)`: questions in `exclude` (e.g. those with an
  experience item still open) are removed from the pools first; then bucket weights from a Gaussian
  over k (count units, mean K/2, sigma 1 by default; the paper's accuracy-unit form with
  `units="accuracy"`), normalised over the buckets that still have questions, multinomial bucket
  counts capped at the (reduced) bucket sizes with leftovers redistributed by the original weights,
  uniform without replacement inside a bucket. `weighting="uniform"` samples the non-excluded
  questions uniformly (the "w/o question selection" ablation). The picks come back in random order,
  not grouped by bucket, so truncating the list cannot bias it.
- memory: token ids int32 + log-probs float32 per token (8 bytes) plus a small per-trajectory
  overhead (a 16-byte de-duplication hash among it). `max_trajectories` caps the total; eviction is FIFO over the whole buffer (the oldest
  stored trajectory goes first; a question left with none leaves its bucket). None, the authors'
  behaviour, never evicts.

Example:
    >>> import numpy as np
    >>> buf = ExperienceBuffer(K=8, seed=0)
    >>> t = Trajectory(np.array([5, 6, 2], np.int32), np.array([-0.1, -0.2, -0.05], np.float32), version=3)
    >>> buf.record(qid=17, k=4, correct=[t, t])   # the duplicate is stored once
    >>> buf.bucket_of(17), len(buf.trajectories(17))
    (4, 1)
    >>> buf.sample_questions(4)
    [17]
    >>> buf.record(qid=17, k=8, correct=[]); buf.end_step(); buf.num_questions
    0
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass
class Trajectory:
    token_ids: np.ndarray  # (T,) int32, the completion (EOS included)
    logprobs: np.ndarray  # (T,) float32, pi_past per token
    version: int  # policy version that generated it


def bucket_weights(K: int, mu: float | None = None, sigma: float = 1.0,
                   units: Literal["count", "accuracy"] = "count") -> dict[int, float]:
    """Unnormalised Gaussian weight of each bucket k = 1..K-1."""
    if units == "count":
        m = K / 2 if mu is None else mu
        return {k: math.exp(-0.5 * ((k - m) / sigma) ** 2) for k in range(1, K)}
    m = 0.5 if mu is None else mu
    return {k: math.exp(-0.5 * ((k / K - m) / sigma) ** 2) for k in range(1, K)}


def _digest(token_ids: np.ndarray) -> bytes:
    """De-duplication key: a 128-bit hash of the token ids (a copy of the ids would cost 4 B/token)."""
    return hashlib.blake2b(np.ascontiguousarray(token_ids, dtype=np.int32).tobytes(), digest_size=16).digest()


class ExperienceBuffer:
    def __init__(self, K: int, max_trajectories: int | None = None, seed: int = 0):
        if K < 2:
            raise ValueError("K must be at least 2")
        self.K, self.max_trajectories = K, max_trajectories
        self.rng = random.Random(seed)
        self._traj: dict[int, list[Trajectory]] = {}
        self._keys: dict[int, set[bytes]] = {}
        self._bucket_of: dict[int, int] = {}
        self._buckets: dict[int, list[int]] = {k: [] for k in range(1, K)}
        self._pos: dict[int, int] = {}  # qid -> index in its bucket list (O(1) removal)
        self._fifo: deque[tuple[int, bytes]] = deque()  # insertion order, for eviction
        self.retired: set[int] = set()
        self.num_trajectories = 0
        self.num_tokens = 0
        self.evicted = 0

    # ------------------------------------------------------------------ updates
    def record(self, qid: int, k: int, correct: list[Trajectory]) -> None:
        if not 0 <= k <= self.K:
            raise ValueError(f"k={k} outside 0..{self.K}")
        if k == self.K:
            self.retire(qid)
            return
        if k == 0 or qid in self.retired:
            return
        self._move(qid, k)
        store, keys = self._traj.setdefault(qid, []), self._keys.setdefault(qid, set())
        for t in correct:
            key = _digest(t.token_ids)
            if key in keys:
                continue
            keys.add(key)
            # own copies: a view (e.g. into a received message frame) would pin its whole base buffer
            store.append(Trajectory(np.array(t.token_ids, np.int32), np.array(t.logprobs, np.float32), t.version))
            self._fifo.append((qid, key))
            self.num_trajectories += 1
            self.num_tokens += len(t.token_ids)
        self._evict()

    def retire(self, qid: int) -> None:
        """Permanent: the question leaves its bucket (so it is never sampled again) now, and its
        trajectories leave the buffer at end_step()."""
        self.retired.add(qid)
        if qid in self._bucket_of:
            self._remove_from_bucket(qid, self._bucket_of.pop(qid))

    def unretire(self, qids: Collection[int]) -> None:
        """Put retired questions back (the Table 7 ablation): they can be collected, and so bucketed and
        replayed, again. Their trajectories left the buffer when they retired."""
        self.retired.difference_update(qids)

    def end_step(self) -> None:
        for qid in [q for q in self._traj if q in self.retired]:
            self._drop(qid)

    # ------------------------------------------------------------------ queries
    def bucket_of(self, qid: int) -> int | None:
        return self._bucket_of.get(qid)

    def trajectories(self, qid: int) -> list[Trajectory]:
        return self._traj.get(qid, [])

    @property
    def num_questions(self) -> int:
        """Questions holding stored trajectories (retired ones until end_step)."""
        return len(self._traj)

    @property
    def nbytes(self) -> int:
        """Payload bytes held: an int32 token id and a float32 log-prob per token, a 16-byte
        de-duplication key per trajectory (Python object overhead not counted)."""
        return 8 * self.num_tokens + 16 * self.num_trajectories

    def bucket_sizes(self, exclude: Collection[int] = ()) -> dict[int, int]:
        """Eligible questions per bucket (retired ones are never in a bucket), less those in `exclude`:
        the pools `sample_questions(..., exclude=exclude)` draws from."""
        removed = self._removed(exclude)
        return {k: len(qs) - removed[k] for k, qs in self._buckets.items()}

    def _removed(self, exclude: Collection[int]) -> dict[int, int]:
        """Questions of `exclude` per bucket (ids in no bucket are ignored)."""
        removed = {k: 0 for k in self._buckets}
        for q in exclude:
            if (k := self._bucket_of.get(q)) is not None:
                removed[k] += 1
        return removed

    def sample_questions(self, n: int, weighting: Literal["gaussian", "gaussian_per_question", "uniform"] = "gaussian",
                         mu: float | None = None, sigma: float = 1.0,
                         units: Literal["count", "accuracy"] = "count",
                         exclude: Collection[int] = ()) -> list[int]:
        """Up to `n` distinct eligible questions, in random order (never grouped by bucket, so a caller
        that truncates the list does not bias it). Questions in `exclude` (e.g. those with an experience
        item in flight) are taken out of the pools first: bucket weights are normalised over the buckets
        that still have questions, caps use the reduced sizes, and `weighting="uniform"` skips them too.
        Ids in `exclude` that are not in a bucket are ignored. Cost O(n + len(exclude)): no pool is copied."""
        if n <= 0:
            return []
        ex = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        removed = self._removed(ex)  # excluded questions per bucket
        size = {k: len(qs) - removed[k] for k, qs in self._buckets.items() if len(qs) > removed[k]}
        if not size:
            return []
        if weighting == "uniform":
            out = self._draw_uniform(n, size, removed, ex)
        elif weighting == "gaussian_per_question":
            out = self._draw_per_question(n, ex, mu, sigma, units)
        else:
            out = self._draw_gaussian(n, size, removed, ex, mu, sigma, units)
        self.rng.shuffle(out)
        return out

    def _draw_gaussian(self, n: int, size: dict[int, int], removed: dict[int, int], ex: Collection[int],
                       mu: float | None, sigma: float, units: Literal["count", "accuracy"]) -> list[int]:
        w = bucket_weights(self.K, mu, sigma, units)
        ks = sorted(size)
        total = sum(w[k] for k in ks)
        p = [w[k] / total for k in ks]
        counts = dict(zip(ks, np.random.default_rng(self.rng.getrandbits(32)).multinomial(n, p).tolist()))
        leftover = 0
        for k in ks:  # cap at bucket sizes (excluded questions not counted)
            over = counts[k] - size[k]
            if over > 0:
                counts[k] -= over
                leftover += over
        while leftover > 0:  # give leftovers back one at a time, by the original weights
            room = [(k, pk) for k, pk in zip(ks, p) if counts[k] < size[k]]
            if not room:
                break
            k = self.rng.choices([k for k, _ in room], weights=[pk for _, pk in room])[0]
            counts[k] += 1
            leftover -= 1
        out: list[int] = []
        for k in ks:
            if counts[k]:
                out += self._draw_from(self._buckets[k], counts[k], removed[k], ex)
        return out

    def _draw_per_question(self, n: int, ex: Collection[int], mu: float | None, sigma: float,
                           units: Literal["count", "accuracy"]) -> list[int]:
        """n questions without replacement, each with the Gaussian weight of its own bucket: a bucket's
        share grows with its size (with buckets of equal size this is the bucket sampler). O(pool)."""
        w = bucket_weights(self.K, mu, sigma, units)
        qids = [q for qs in self._buckets.values() for q in qs if q not in ex]
        weights = np.array([w[self._bucket_of[q]] for q in qids], np.float64)
        n = min(n, int((weights > 0).sum()))
        pick = np.random.default_rng(self.rng.getrandbits(32)).choice(len(qids), n, replace=False,
                                                                       p=weights / weights.sum())
        return [qids[i] for i in pick.tolist()]

    def _draw_from(self, pool: list[int], c: int, removed: int, ex: Collection[int]) -> list[int]:
        """c questions uniformly without replacement from `pool` minus the `removed` excluded ones in it:
        the first c non-excluded entries of a random ordering all lie within its first c + removed."""
        if not removed:
            return self.rng.sample(pool, c)
        return [q for q in self.rng.sample(pool, min(len(pool), c + removed)) if q not in ex][:c]

    def _draw_uniform(self, n: int, size: dict[int, int], removed: dict[int, int], ex: Collection[int]) -> list[int]:
        """Uniform without replacement over every eligible, non-excluded question: random positions in
        the buckets laid end to end (`range` is sampled without being materialised)."""
        ks = [k for k in self._buckets if self._buckets[k]]
        offsets, total = [], 0
        for k in ks:
            offsets.append(total)
            total += len(self._buckets[k])
        n = min(n, sum(size.values()))
        out: list[int] = []
        for i in self.rng.sample(range(total), min(total, n + sum(removed.values()))):
            j = bisect.bisect_right(offsets, i) - 1
            q = self._buckets[ks[j]][i - offsets[j]]
            if q not in ex:
                out.append(q)
                if len(out) == n:
                    break
        return out

    # ------------------------------------------------------------------ internals
    def _move(self, qid: int, k: int) -> None:
        old = self._bucket_of.get(qid)
        if old == k:
            return
        if old is not None:
            self._remove_from_bucket(qid, old)
        self._bucket_of[qid] = k
        self._pos[qid] = len(self._buckets[k])
        self._buckets[k].append(qid)

    def _remove_from_bucket(self, qid: int, k: int) -> None:
        lst, i = self._buckets[k], self._pos.pop(qid)
        last = lst.pop()
        if last != qid:
            lst[i] = last
            self._pos[last] = i

    def _drop(self, qid: int) -> None:
        if qid in self._bucket_of:
            self._remove_from_bucket(qid, self._bucket_of.pop(qid))
        for t in self._traj.pop(qid, []):
            self.num_trajectories -= 1
            self.num_tokens -= len(t.token_ids)
        self._keys.pop(qid, None)

    def _evict(self) -> None:
        if self.max_trajectories is None:
            return
        while self.num_trajectories > self.max_trajectories:
            qid, key = self._fifo.popleft()
            store = self._traj.get(qid)
            if store is None or key not in self._keys[qid]:
                continue  # already gone with its retired question
            i = next(j for j, t in enumerate(store) if _digest(t.token_ids) == key)
            victim = store.pop(i)
            self._keys[qid].discard(key)
            self.num_trajectories -= 1
            self.num_tokens -= len(victim.token_ids)
            self.evicted += 1
            if not store:
                self._drop(qid)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: plain Python values (JSON-able apart from the rng
        tuple) and a few flat numpy arrays. Trajectories are concatenated with per-trajectory lengths
        (thousands of tiny arrays would each cost a file entry), questions keep their insertion order,
        bucket lists their order (sampling picks by position), and the FIFO is stored as (qid, index of
        the trajectory in its question's list), or -1 and the 16-byte key in `fifo_stale` for entries of
        questions already dropped (eviction skips those)."""
        qids = list(self._traj)
        trajs = [t for q in qids for t in self._traj[q]]
        index = {(q, _digest(t.token_ids)): i for q in qids for i, t in enumerate(self._traj[q])}
        return {
            "K": self.K, "max_trajectories": self.max_trajectories, "rng": self.rng.getstate(),
            "retired": sorted(self.retired), "evicted": self.evicted,
            "buckets": [[k, list(qs)] for k, qs in self._buckets.items()],
            "qids": np.array(qids, np.int64), "counts": np.array([len(self._traj[q]) for q in qids], np.int64),
            "lengths": np.array([len(t.token_ids) for t in trajs], np.int64),
            "versions": np.array([t.version for t in trajs], np.int64),
            "token_ids": np.concatenate([t.token_ids for t in trajs]) if trajs else np.zeros(0, np.int32),
            "logprobs": np.concatenate([t.logprobs for t in trajs]) if trajs else np.zeros(0, np.float32),
            "fifo_qid": np.array([q for q, _ in self._fifo], np.int64),
            "fifo_idx": np.array([index.get((q, key), -1) for q, key in self._fifo], np.int64),
            "fifo_stale": np.frombuffer(b"".join(key for q, key in self._fifo if (q, key) not in index),
                                        np.uint8).reshape(-1, 16),
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace this buffer's contents by `state` (from `state_dict`); K and the cap come from it."""
        self.__init__(int(state["K"]), state["max_trajectories"])
        ends = np.cumsum(np.asarray(state["lengths"], np.int64))
        tok, lp, ver = np.asarray(state["token_ids"]), np.asarray(state["logprobs"]), state["versions"]
        j = 0
        for qid, n in zip(np.asarray(state["qids"]).tolist(), np.asarray(state["counts"]).tolist()):
            store = self._traj[qid] = []
            for _ in range(n):
                a = ends[j - 1] if j else 0
                store.append(Trajectory(np.array(tok[a:ends[j]], np.int32), np.array(lp[a:ends[j]], np.float32),
                                        int(ver[j])))
                self.num_trajectories += 1
                self.num_tokens += int(ends[j] - a)
                j += 1
            self._keys[qid] = {_digest(t.token_ids) for t in store}
        for k, qs in state["buckets"]:
            self._buckets[int(k)] = [int(q) for q in qs]
            for i, q in enumerate(self._buckets[int(k)]):
                self._bucket_of[q], self._pos[q] = int(k), i
        stale = iter(np.asarray(state["fifo_stale"], np.uint8).reshape(-1, 16))
        self._fifo = deque((q, _digest(self._traj[q][i].token_ids) if i >= 0 else next(stale).tobytes())
                           for q, i in zip(np.asarray(state["fifo_qid"]).tolist(),
                                           np.asarray(state["fifo_idx"]).tolist()))
        self.retired = {int(q) for q in state["retired"]}
        self.evicted = int(state["evicted"])
        self.rng.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["rng"]))
