"""What the learner's maths asks of its ranks: a place among them and three reductions.

The update (learner/maths/update.py) and the buffer's selection pass run on one rank or on several in
lockstep. They reduce through this small protocol, not through the process shell's `learner.ranks.Ranks`
(which implements it over torch.distributed), so the maths imports nothing of the shell and runs alone on
`SOLO`. `split_by_tokens` deals a mini-batch's sequences to the ranks by tokens.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Collectives(Protocol):
    """This rank's place (`rank` of `world`) and the reductions every rank enters in the same order."""

    rank: int
    world: int

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks."""
        ...

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (msgpack-able), in rank order, on every rank."""
        ...


class Solo:
    """One rank, no process group: every reduction is the identity."""

    rank, world = 0, 1

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def max(self, values: list[float]) -> list[float]:
        return list(values)

    def gather(self, obj: Any) -> list[Any]:
        return [obj]


SOLO = Solo()


def split_by_tokens(lengths: list[int], world: int) -> list[list[int]]:
    """Indices of `lengths` dealt to `world` ranks so their token counts are close (longest first, each
    to the rank with the fewest tokens so far; ties to the lower rank). Deterministic: every rank
    computes the same split. Each rank's indices come back in ascending order."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]
