"""The learner's ranks: the processes that train one step together, and what they say to each other.

`learner.world_size` ranks (one per GPU; CPU processes on gloo in tests) hold one FSDP2-sharded policy.
Rank 0 (the lead) runs the loop: server, dispatcher, experience buffer. The other ranks follow: they
wait for the next operation the lead announces (update, score, publish, state, stop; learner/policy.py)
and run it with the lead, so every collective (FSDP2's all-gathers and reduce-scatters, the publish
gather, the step's reductions) is entered by every rank in the same order.

Announcements and results travel as msgpack in uint8 tensors over the default process group, never
pickle. A follower waits for the next announcement outside any collective: on a key the lead sets in
the group's TCP store just before it broadcasts (under `train` the store lives in the lead's process,
so a lead that dies ends the wait at once). The collective timeout (`learner.rank_timeout_s`, NCCL's
watchdog) then bounds only the collectives themselves, never the lead's own work in between (an
evaluation, a checkpoint, the summary), however long that takes; the final barrier is entered the
same way. World size 1 has no process group: announcements are dropped and reductions are the identity.
The group comes from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK),
which `exgrpo-async train` sets for the ranks it starts itself.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, NoReturn

import msgpack
import torch
import torch.distributed as dist

from exgrpo_async.logs import end_process

MAX_MESSAGE_BYTES = 1 << 30  # one step's sequences; anything bigger is a bug
FOLLOWER_POLL_S = 600.0  # a follower's wait for the lead in store waits this long each (c10d logs each timeout)
BELL_KEYS_KEPT = 16  # announcements' keys the lead leaves in the store (a follower is at most one behind)


class Ranks:
    """This process's place among the learner's ranks, and the few collectives the loop needs."""

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device = torch.device("cpu"),
                 bell: dist.Store | None = None):
        self.rank, self.world, self.device = rank, world, device
        self._bell, self._rung = bell, 0  # the store keys that say "the lead is ready", and how many so far
        self.in_operation = False  # the lead, between announcing an operation and finishing it
        self.stop_requested = False  # SIGTERM came during an operation: stop once it is over

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, world_size: int, device_setting: str, timeout_s: float) -> "Ranks":
        """Join the learner's process group described by torchrun's variables (world size 1 without them).

        `world_size` is the configured `learner.world_size`; torchrun's WORLD_SIZE must agree with it."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != world_size:
            raise ValueError(f"learner.world_size={world_size} but the environment says WORLD_SIZE={world} "
                             "(torchrun --nproc-per-node and learner.world_size must agree)")
        if world == 1:
            return cls()
        rank = int(os.environ["RANK"])
        cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))  # torchrun's agent store too
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        return cls(rank, world, device, dist.PrefixStore("exgrpo/lead/", store))

    # ------------------------------------------------------------------ lead -> followers
    @contextmanager
    def together(self, op: str, payload: dict[str, Any]) -> Iterator[None]:
        """Lead: announce `op`, then run its part of the operation's collectives; a SIGTERM meanwhile
        (`request_stop`) takes effect when the operation is over, as SystemExit(143). A lead that left
        mid-operation would announce "stop" while the followers sit in the operation's next collective:
        mismatched collectives, a hang until the launcher's SIGKILL. Followers and one rank: just runs."""
        if self.world == 1 or not self.lead:
            yield
            return
        self.in_operation = True
        try:
            self.announce(op, payload)
            yield
        finally:
            self.in_operation = False
        if self.stop_requested:
            raise SystemExit(143)

    def request_stop(self) -> None:
        """The lead's SIGTERM: SystemExit(143) now, or at the end of the operation under way."""
        if self.in_operation:
            self.stop_requested = True
            return
        raise SystemExit(143)

    def announce(self, op: str, payload: dict[str, Any]) -> None:
        """Lead: tell the followers the next operation (they block in `receive` until it comes). A
        follower running the same operation calls this too, and nothing happens."""
        if self.world > 1 and self.lead:
            self._rung += 1
            self._ring(f"op/{self._rung}")
            if self._bell is not None and self._rung > BELL_KEYS_KEPT:
                self._bell.delete_key(f"op/{self._rung - BELL_KEYS_KEPT}")
            self._broadcast_bytes(msgpack.packb({"op": op, **payload}, use_bin_type=True))

    def receive(self) -> tuple[str, dict[str, Any]]:
        """Follower: the next operation the lead announces, and its payload. Waits as long as the lead
        takes to announce it, outside any collective (the module docstring says why)."""
        self._rung += 1
        self._wait_for_lead(f"op/{self._rung}")
        msg = msgpack.unpackb(self._broadcast_bytes(None), raw=False, strict_map_key=False)
        return msg.pop("op"), msg

    def meet_at_end(self) -> None:
        """Every rank: the final barrier, which the lead enters when it has finished everything; the
        followers wait for that outside the collective, as for an announcement."""
        if self.world == 1:
            return
        if self.lead:
            self._ring("end")
        else:
            self._wait_for_lead("end")
        dist.barrier()

    def _ring(self, key: str) -> None:
        if self._bell is not None:
            self._bell.set(key, b"")

    def _wait_for_lead(self, key: str) -> None:
        """Block until the lead sets `key`. A store wait's timeout only means the lead is still busy; a
        lead that is gone closes the store's connection, which raises here (DistNetworkError)."""
        if self._bell is None:
            return
        while True:
            try:
                self._bell.wait([key], timedelta(seconds=FOLLOWER_POLL_S))
                return
            except dist.DistStoreError:
                if self._bell.check([key]):
                    return

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(n, 0)
        size = int(n.item())
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"learner rank message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data is not None
               else torch.empty(size, dtype=torch.uint8, device=self.device))
        dist.broadcast(buf, 0)
        return bytes(buf.cpu().numpy())

    # ------------------------------------------------------------------ reductions
    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (fp64)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: list[float], op) -> list[float]:
        if self.world == 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.cpu().tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's msgpack-able `obj`, in rank order (on every rank)."""
        if self.world == 1:
            return [obj]
        data = msgpack.packb(obj, use_bin_type=True)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data else mine[:0]
        bufs = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        dist.all_gather(bufs, mine)
        return [msgpack.unpackb(bytes(b[:int(s.item())].cpu().numpy()), raw=False, strict_map_key=False)
                for b, s in zip(bufs, sizes)]

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def end_rank_process(rc: int) -> NoReturn:
    """End a learner rank (after `Ranks.close`) without the interpreter's finalization.

    destroy_process_group does not free a gloo group that FSDP2 used: DTensor's global caches keep its
    DeviceMesh, so the group's worker threads outlive it. A worker that lets go of the last
    collective's work after the main thread has returned holds the last reference to that work's
    tensors; releasing them during finalization takes the GIL from a thread Python is tearing down,
    and the process aborts ("terminate called without an active exception", exit 134; pytorch PR
    179291). In a loop of 2-rank lifecycles 7 of 110 clean exits aborted, mostly the follower, which
    returns right after its last broadcast; `ops/bench/system/rank_exit_stress.py --endings bare,plain_exit` counts
    them. One rank ends the same way: finalizing torch takes seconds."""
    end_process(rc)
