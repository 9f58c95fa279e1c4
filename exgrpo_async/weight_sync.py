"""Weight sync from the learner to actors over torch.distributed (seam 5 of 5).

One code path for CPU and GPU: gloo with CPU tensors, NCCL with CUDA tensors; only the backend and the
tensor device differ. Each actor gets its own small group: rank 0 is the learner, ranks 1..tp are that
actor's vLLM workers. A group per actor (rather than one group over all actors) means an actor can join
or leave without rebuilding anybody else's group, and a slow actor never holds back a fast one; the
learner serves the groups one after the other from a background thread.

Protocol of one sync (learner side `WeightPublisher.send`, worker side `WeightReceiver.receive`):
- weights travel in buckets of about `bucket_mb`, each one flat tensor of one dtype;
- the receiver gets `meta` (over ZeroMQ, before the broadcast): per bucket a list of
  (name, dtype, shape) in Hugging Face parameter names;
- the learner issues every bucket broadcast at once; the receiver keeps one bucket in flight while it
  loads the previous one into the engine, so the load hides behind the transfer.
- the learner waits for its broadcasts by polling their completion (for NCCL, events on the
  collective's own stream: no device-wide synchronize, so one actor's stuck broadcast never holds up
  the learner's other streams) until `timeout_s`; a broadcast not done by then aborts that actor's
  group and raises `SyncTimeout`. NCCL's own timeout on the group is set later than ours
  (`NCCL_GRACE_S`), so its watchdog, which would end the whole learner process, never fires first.

Receive buffers: on CPU (gloo) a worker keeps one flat buffer per bucket across syncs (the pre-packed
reload replays views into them, actors/cpu_reload.py). On GPU (`ring=True`) each bucket is received
into a fresh buffer from the caching allocator, never into one a loader may still read (vLLM's
layerwise reload holds a fused layer's first tensors until its last one arrives, possibly a bucket
later); a TP worker then holds the buckets in flight and those the loader keeps, not a copy of the
model. A receive whose buckets must outlive the load (in-flight updates stage the whole broadcast
before the engine pauses) copies each bucket to host memory as it arrives.

Every group's first collective is a bounded 1-element broadcast (`warm_up`): NCCL forms its
communicator lazily inside the first collective, blocking the caller until every rank has come.

The store listens on the learner's `transport.host` only. Neither it nor the broadcasts are encrypted or
authenticated: keep them on a trusted network (docs/architecture.md, Security).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from exgrpo_async.fingerprint import expected

Meta = list[list[tuple[str, str, list[int]]]]  # buckets of (name, dtype name, shape)
NCCL_GRACE_S = 60.0  # NCCL's watchdog timeout on a weight-sync group: ours plus this
KEEP_FINGERPRINTS = 16  # versions whose fingerprints the publisher keeps for late reports


class SyncTimeout(TimeoutError):
    """A broadcast did not complete within `timeout_s`; its group has been aborted."""


def make_group(host: str, port: int, prefix: str, rank: int, world_size: int, backend: str,
               timeout_s: float, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Build a private process group without touching torch.distributed's default group.

    The learner passes its master `store`; workers connect to it as clients. `prefix` separates the
    keys of different actors' groups (and of successive groups of one actor) in that store.
    """
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    pstore = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout + timedelta(seconds=NCCL_GRACE_S)  # our own deadline (wait_all) comes first
        return dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    raise ValueError(f"unknown weight-sync backend {backend!r} (gloo or nccl)")


def _listen(host: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on `host` only, as (fd, port) for TCPStore's `master_listen_fd`.

    TCPStore itself binds every interface; this keeps the store on the configured address. The fd is
    handed over (TCPStore closes it)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock.detach(), port


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def warm_up(pg: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
    """One 1-element broadcast, bounded by `timeout_s`, as soon as a group is formed, on every rank of it.

    NCCL builds its communicator lazily, inside a group's first collective, and that handshake blocks the
    calling thread until every rank has joined: a peer that asked for its group and then stalled would
    hold the sync thread there, out of `wait_all`'s reach, with a buffer set checked out. So the first
    collective runs in a helper thread, and a group whose handshake misses the deadline is aborted
    (`SyncTimeout`). With gloo the rendezvous already happened when the group was built; this is one
    more tiny broadcast."""
    box: dict = {}

    def first() -> None:
        try:
            box["work"] = _broadcast(pg, torch.zeros(1, device=device))
        except BaseException as e:  # surfaced below
            box["error"] = e

    t0 = time.monotonic()
    helper = threading.Thread(target=first, name="ws-warm-up", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        # abort from yet another thread: NCCL may hold the group's lock through the blocked handshake
        threading.Thread(target=pg.abort, name="ws-abort", daemon=True).start()
        raise SyncTimeout(f"weight-sync group not formed after {timeout_s:.0f}s (a peer never joined the handshake)")
    if "error" in box:
        raise box["error"]
    wait_all([box["work"]], max(0.0, timeout_s - (time.monotonic() - t0)))


def wait_all(works: list[dist.Work], timeout_s: float, poll_s: float = 0.001) -> None:
    """Block this thread until every collective in `works` has completed, or raise `SyncTimeout` after
    `timeout_s`. Completion is polled (`is_completed`: for NCCL, the collective's CUDA events), so no
    stream and no other thread is made to wait; a failed collective raises here."""
    deadline = time.monotonic() + timeout_s
    for w in works:
        while not w.is_completed():
            if time.monotonic() >= deadline:
                raise SyncTimeout(f"broadcast not complete after {timeout_s:.0f}s")
            time.sleep(poll_s)
        w.wait()  # raises a failed collective's error (immediate once complete)


def _group(name: str) -> str:
    """The block a parameter belongs to: "model.layers.3.self_attn" for "model.layers.3.self_attn.q_proj.weight"."""
    return name.rsplit(".", 2)[0]


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None) -> Meta:
    """Group parameters into same-dtype buckets of about `bucket_bytes` (a big tensor gets its own);
    with `dtype`, every parameter travels as that dtype (fp32 master weights sent to bf16 actors).

    Within each block (parameters sharing the prefix before their module's name) the matrices come
    first, in model order, and a block that fits in a bucket is never split across two. So the
    projections an inference engine fuses (q/k/v, gate/up) lie back to back in one flat buffer, already
    in the fused layout: a CPU actor can re-pack them straight from its receive buffer (actors/cpu_reload.py).
    """
    blocks: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        blocks.setdefault(_group(name), []).append((name, t))
    buckets: Meta = []
    cur: list[tuple[str, str, list[int]]] = []
    cur_bytes, cur_dtype = 0, None
    for block in blocks.values():
        block = [x for x in block if x[1].dim() >= 2] + [x for x in block if x[1].dim() < 2]
        if cur and cur_bytes + sum(t.numel() * _itemsize(t, dtype) for _, t in block) > bucket_bytes:
            buckets.append(cur)  # the whole block would not fit: start it in a fresh bucket
            cur, cur_bytes = [], 0
        for name, t in block:
            name_dtype = str(dtype or t.dtype).removeprefix("torch.")
            size = t.numel() * _itemsize(t, dtype)
            if cur and (name_dtype != cur_dtype or cur_bytes + size > bucket_bytes):
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append((name, name_dtype, list(t.shape)))
            cur_bytes, cur_dtype = cur_bytes + size, name_dtype
    if cur:
        buckets.append(cur)
    return buckets


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole: gathered from the learner's ranks if sharded (a DTensor; collective), else itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _itemsize(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return (dtype or t.dtype).itemsize


class WeightPublisher:
    """Learner side: keeps the latest packed weights and broadcasts them to one actor group at a time.

    `publish` is called by the training loop after each optimizer step. It copies the parameters into
    a persistent set of flat buffers (allocating once, not per step), never into a set that a send is
    still using: `checkout` marks the set a sync job will send, `release` frees it. `open_group`,
    `send` and `close_group` are called from the sync thread only.

    `max_sets` bounds the sets (each the model's size in the actors' dtype: 15 GB at 7B in bf16, on the
    lead's GPU): when every set is held by a send, `publish` waits for one to be released (sends end
    within `timeout_s`, or abort) instead of allocating another; with one set it repacks it in place,
    and a `checkout` waits while it does. None: never wait, allocate (the CPU default).
    """

    def __init__(self, host: str, port: int, backend: str, device: torch.device, bucket_mb: int, timeout_s: float,
                 max_sets: int | None = None):
        if max_sets is not None and max_sets < 1:
            raise ValueError(f"max_sets must be at least 1, got {max_sets}")
        self.max_sets = max_sets
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self.bucket_bytes = bucket_mb << 20
        fd, port = _listen(host, port)
        self.store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=fd)
        self.host, self.port = host, self.store.port
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._aborted: list[dist.ProcessGroup] = []  # aborted groups not yet freed (see close_group)
        self._lock = threading.Condition()  # a lock; `release` and the end of a repack notify waiters
        self.version = -1
        self.meta: Meta = []
        self._sets: list[list[torch.Tensor]] = []  # flat bucket buffers, reused across versions
        self._users: list[int] = []  # sync jobs holding each set
        self._current = -1
        self._packing = -1  # the set `publish` is writing (checkout waits for it with max_sets=1)
        self._fingerprints: dict[int, dict[str, int]] = {}  # version -> fingerprint, the last few

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> None:
        """Pack the given parameters (HF names) into flat buckets on the sync device, cast to `dtype` (the
        actors') if given, a bucket at a time; becomes `version`."""
        meta = plan_buckets(named, self.bucket_bytes, dtype)
        by_name = dict(named)
        with self._lock:
            if meta != self.meta:  # first publish, or the model changed shape: start over
                self._sets, self._users, self._current = [], [], -1
            idx = self._set_to_fill()
            if idx == len(self._sets):
                self._sets.append([torch.empty(sum(_numel(sh) for _, _, sh in b), dtype=getattr(torch, b[0][1]),
                                               device=self.device) for b in meta])
                self._users.append(0)
            self._packing = idx
        try:
            with torch.no_grad():
                for buf, bucket in zip(self._sets[idx], meta):
                    torch.cat([full_tensor(by_name[n]).detach().reshape(-1).to(buf.dtype) for n, _, _ in bucket],
                              out=buf)
        finally:
            with self._lock:
                self.version, self.meta, self._current, self._packing = version, meta, idx, -1
                self._lock.notify_all()

    def _set_to_fill(self) -> int:
        """(Under the lock.) A set no send holds, other than the newest unless only one is allowed; a new
        set's index (len) while `max_sets` allows; else wait for a release, at most twice `timeout_s`."""
        deadline = time.monotonic() + 2 * self.timeout_s
        while True:
            free = [i for i in range(len(self._sets)) if self._users[i] == 0 and (i != self._current or self.max_sets == 1)]
            if free:
                return free[0]
            if self.max_sets is None or len(self._sets) < self.max_sets:
                return len(self._sets)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"publish: every packed set ({self.max_sets}) still held by a send after "
                                  f"{2 * self.timeout_s:.0f}s (a send ends within weight_sync.timeout_s)")
            self._lock.wait(left)

    def snapshot(self) -> tuple[int, Meta, list[torch.Tensor]]:
        """Latest (version, meta, flat buckets), for reading now (no hold on the buffers)."""
        with self._lock:
            return self.version, self.meta, self._sets[self._current]

    def checkout(self) -> tuple[int, Meta, list[torch.Tensor], int]:
        """Like `snapshot`, but the buffers stay untouched by `publish` until `release(token)`."""
        with self._lock:
            deadline = time.monotonic() + 2 * self.timeout_s
            while self._packing == self._current:  # one set, being repacked: the next version comes next
                if not self._lock.wait(max(0.0, deadline - time.monotonic())):
                    raise SyncTimeout(f"checkout: the publish set was still being repacked after {2 * self.timeout_s:.0f}s")
            self._users[self._current] += 1
            return self.version, self.meta, self._sets[self._current], self._current

    def release(self, token: int) -> None:
        with self._lock:
            if token < len(self._users):
                self._users[token] -= 1
                self._lock.notify_all()

    def fingerprint(self, version: int, meta: Meta, flat: list[torch.Tensor]) -> dict[str, int]:
        """The fingerprint (exgrpo_async/fingerprint.py) of `version`, packed in `flat` (checked out);
        computed once per version, the last few kept (`expected_fingerprint`)."""
        with self._lock:
            if version in self._fingerprints:
                return self._fingerprints[version]
        named = {}
        for bucket, buf in zip(meta, flat):
            off = 0
            for name, _, shape in bucket:
                n = _numel(shape)
                named[name] = buf[off:off + n].view(shape)
                off += n
        fp = expected(named)
        with self._lock:
            self._fingerprints[version] = fp
            while len(self._fingerprints) > KEEP_FINGERPRINTS:
                self._fingerprints.pop(min(self._fingerprints))
        return fp

    def expected_fingerprint(self, version: int) -> dict[str, int] | None:
        """`version`'s fingerprint, if it was computed (for a sync) and is among the last few."""
        with self._lock:
            return self._fingerprints.get(version)

    def open_group(self, key: str, world_size: int) -> None:
        """Join a new actor's group as rank 0 (blocks until the actor's workers join, or `timeout_s`).

        Each group talks to the store over its own client connection: the master store object holds
        one lock over its connection for the whole of a blocking wait, so a rendezvous through it that
        never completes (an actor that asked for its group, then stalled) would hold up every other
        actor's rendezvous until it timed out. `self` stays referenced by this frame while it waits, so
        the master outlives a rendezvous still pending when the process exits."""
        self.close_group(key)
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        pg = make_group(self.host, self.port, f"ws/{key}/", 0, world_size, self.backend, self.timeout_s, store=store)
        warm_up(pg, self.device, self.timeout_s)  # raises SyncTimeout (group aborted) if a worker never comes
        self.groups[key] = pg

    def send(self, key: str, flat: list[torch.Tensor]) -> float:
        """Broadcast the given packed buckets to one actor's group; returns seconds spent. A broadcast
        not complete within `timeout_s` (the actor died or froze) aborts the group: `SyncTimeout`."""
        t0 = time.perf_counter()
        pg = self.groups[key]
        works = [_broadcast(pg, t) for t in flat]
        try:
            wait_all(works, self.timeout_s)
        except SyncTimeout:
            self.close_group(key, abort=True)
            raise
        return time.perf_counter() - t0

    def close_group(self, key: str, abort: bool = False) -> None:
        """Leave an actor's group; `abort` cancels its pending collectives first (a peer that is gone)."""
        pg = self.groups.pop(key, None)
        if pg is not None:
            try:
                if abort:
                    pg.abort()
                    # freeing a group blocks until its pending collectives fail (gloo: its own timeout);
                    # keep the last few aborted ones referenced so this thread goes on at once
                    self._aborted = self._aborted[-15:] + [pg]
                else:
                    pg.shutdown()
            except Exception:  # a dead peer's group may fail to shut down; it is dropped either way
                pass


class WeightReceiver:
    """Worker side (inside a vLLM worker process): joins its actor's group and yields received buckets.

    `ring=False` (CPU): one persistent buffer per bucket. `ring=True` (GPU): a fresh buffer per bucket
    from the caching allocator, so a bucket's views stay valid for as long as the consumer keeps them."""

    def __init__(self, host: str, port: int, prefix: str, rank: int, world_size: int, backend: str,
                 device: torch.device, timeout_s: float, ring: bool = False):
        self.device, self.ring = device, ring
        self.pg = make_group(host, port, prefix, rank, world_size, backend, timeout_s)
        warm_up(self.pg, device, timeout_s)
        self._bufs: list[torch.Tensor] = []  # CPU: kept across syncs (fresh large buffers cost page faults)
        self._plan: list[tuple[str, int]] = []
        self._host: dict[int, torch.Tensor] = {}  # GPU with `keep`: each bucket's page-locked host copy

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat receive buffers (one per bucket), reused while the bucket plan stays the same; none
        with `ring` (each bucket gets a fresh one)."""
        return self._bufs

    def _buffer(self, i: int, dtype: str, n: int) -> torch.Tensor:
        if not self.ring:
            return self._bufs[i]
        # GPU: a fresh buffer per bucket from the caching allocator. A loader may keep views of a bucket
        # until a fused layer is complete (vLLM's layerwise reload copies a layer only once all its
        # tensors arrived, and a fused gate/up may span two buckets): memory that a live view points
        # into is never handed out again, and NCCL records its stream on the buffer, so a freed one is
        # reused only after its broadcast has finished.
        return torch.empty(n, dtype=getattr(torch, dtype), device=self.device)

    def receive(self, meta: Meta, keep: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket as (name, tensor) views while the next bucket is still in flight. With `ring`
        and `keep` (the caller holds every bucket until the end), each bucket is copied to page-locked
        host memory."""
        plan = [(b[0][1], sum(_numel(shape) for _, _, shape in b)) for b in meta]
        if plan != self._plan and not self.ring:
            self._bufs = [torch.empty(n, dtype=getattr(torch, dt), device=self.device) for dt, n in plan]
            self._plan = plan

        def start(i: int):
            buf = self._buffer(i, *plan[i])
            return buf, _broadcast(self.pg, buf)

        pending = start(0) if meta else None
        for i, bucket in enumerate(meta):
            buf, work = pending
            work.wait()
            pending = start(i + 1) if i + 1 < len(meta) else None
            if self.ring and keep:
                buf = self._to_host(i, buf)  # waits for this bucket only; the next one's broadcast is queued
            out, off = [], 0
            for name, _, shape in bucket:
                n = _numel(shape)
                out.append((name, buf[off:off + n].view(shape)))
                off += n
            yield out

    def _to_host(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        """A copy of bucket i in page-locked host memory (kept per bucket and reused: the caller is done
        with a sync's buckets before the next sync), which the device copies at full speed both ways."""
        host = self._host.get(i)
        if host is None or host.shape != buf.shape or host.dtype != buf.dtype:
            host = self._host[i] = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=buf.is_cuda)
        host.copy_(buf)
        return host

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # shutting down a group whose peer is gone may raise; nothing left to free
            pass


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
