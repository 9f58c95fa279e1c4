"""The learner's check that every actor runs the weights it was sent (exgrpo_async/fingerprint.py).

An actor reports, in its first work request after a load, the fingerprint of the weights its engine
computes with. `FingerprintCheck.check` compares it with the fingerprint of the version the learner
sent it: a mismatch is counted (`weight_fingerprint_mismatches`), logged with the blocks that differ,
and marks (actor, version) tainted, so that no rollout that actor generated with that version is
trained on (`tainted`; the server re-issues its question and counts `fingerprint_rejected_groups`)
and the server sends the weights again. When the actor then reports a matching fingerprint for the
same version (the learner had not moved on), the taint ends for work handed out from then on: work it
held before stays rejected, being generated with the bad load. Without that, actors tainted at a
version the learner cannot leave (every actor's load corrupted, no step possible) would have every
rollout refused forever. A report the learner cannot compare (the version's fingerprint is no longer
kept) is counted as `fingerprints_unchecked`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

from exgrpo_async.fingerprint import MASK, mismatched
from exgrpo_async.seams import WeightSender
from exgrpo_async.wire import WireError

log = logging.getLogger("exgrpo_async.learner.server")

MAX_BLOCKS = 1 << 14  # blocks in one fingerprint: a few per layer
KEEP_TAINTED = 1024  # (actor, version) pairs remembered


class FingerprintCheck:
    def __init__(self, publisher: WeightSender, counters: Counter):
        self.publisher, self.counters = publisher, counters
        # (actor, version) -> None while tainted, or when the actor reported that version's weights right
        # again (time.monotonic(), the dispatcher's clock): work handed out after that is clean
        self._tainted: OrderedDict[tuple[str, int], float | None] = OrderedDict()

    def check(self, actor_id: str, version: int, reported) -> bool:
        """False if `reported` (an actor's fingerprint of `version`) differs from what was published."""
        if (not isinstance(reported, dict) or len(reported) > MAX_BLOCKS
                or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MASK
                           for k, v in reported.items())):
            raise WireError("bad fingerprint field")
        want = self.publisher.expected_fingerprint(version)
        if want is None:
            self.counters["fingerprints_unchecked"] += 1
            return True
        self.counters["fingerprints_checked"] += 1
        bad = mismatched(reported, want)
        key = (actor_id, version)
        if not bad:
            if key in self._tainted and self._tainted[key] is None:
                self._tainted[key] = time.monotonic()
                log.info("%s now runs the weights of version %d it was sent again", actor_id, version)
            return True
        self.counters["weight_fingerprint_mismatches"] += 1
        self._tainted[key] = None
        self._tainted.move_to_end(key)
        while len(self._tainted) > KEEP_TAINTED:
            self._tainted.popitem(last=False)
        log.error("%s does not run the weights of version %d it was sent: %d of %d blocks differ (%s); none of its "
                  "rollouts of that version are trained on, and its weights are sent again", actor_id, version,
                  len(bad), len(want), ", ".join(bad[:4]) + (", ..." if len(bad) > 4 else ""))
        return False

    def tainted(self, actor_id: str, version: int, dispatched_at: float) -> bool:
        """Whether a group of `version` from `actor_id`, whose work was handed out at `dispatched_at`
        (time.monotonic()), may have been generated with weights that failed the check."""
        if (actor_id, version) not in self._tainted:
            return False
        clean_since = self._tainted[(actor_id, version)]
        return clean_since is None or dispatched_at < clean_since
