"""Rollout transport throughput: actor -> learner over ZeroMQ, against a raw in-process memory copy.

What it measures, per completion length (512 and 4096 tokens, groups of K=8 completions, int32 ids +
float32 log-probs, a 64-token prompt):
- zmq: a spawned sender process (the actor side: `ActorSocket` + `encode_rollouts`) streams N groups
  over TCP loopback to the main process (the learner side: `LearnerSocket.recv` + `decode_header` +
  `decode_rollouts`, i.e. a full decode into a `RolloutGroup`). The clock runs on the receiver, from the
  "go" it sends to the last group decoded; encode, transfer and decode are all inside it.
- pre-enc: the same with frames encoded before timing (sender only sends): the encode cost taken out.
- memcpy: the same frames copied in one process (`np.copy` of each array frame, `bytes` of the header),
  the ceiling any transport of these bytes can approach on this machine.
- codec: encode_rollouts + decode_header + decode_rollouts in one process, no socket (per-group cost).
ratio = zmq MB/s / memcpy MB/s. Bytes counted per group = the three array frames + the msgpack header.
The groups are built before timing: a pool of distinct groups (64 MB, twice the L3 cache) sent
round-robin. Median of 5 repeats.
Target: >= 1000 MB/s between two processes for 4096-token completions.

    .venv/bin/python ops/bench/system/transport.py [--out bench_out/transport.json]

(`--tokens`, `--groups` and `--repeats` make it smaller: tests/unit/test_bench_system.py's tiny run.)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.transport import ActorSocket, LearnerSocket
from exgrpo_async.wire import decode_header, decode_rollouts, encode_control, encode_rollouts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper
import bench  # noqa: E402

K, PROMPT_TOKENS, REPEATS, TARGET_MBS = 8, 64, 5, 1000.0
POOL_BYTES = 64 << 20  # distinct groups cycled through: twice this machine's 32 MiB L3, so copies are not cache-hot
GROUPS = {512: 40000, 4096: 8000}  # groups sent per repeat: about 1.3 GB and 2.1 GB


def pool_size(tokens: int) -> int:
    return max(64, POOL_BYTES // (K * tokens * 8))


def make_groups(tokens: int, n: int, seed: int = 0) -> list[RolloutGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(n):
        comps = [Completion(rng.integers(0, 100, tokens, dtype=np.int32), -rng.random(tokens, dtype=np.float32),
                            float(j % 2), "length", "ok") for j in range(K)]
        groups.append(RolloutGroup(i, i, rng.integers(0, 100, PROMPT_TOKENS, dtype=np.int32), comps, 3, "actor-1",
                                   "train", 1.5))
    return groups


def group_bytes(group: RolloutGroup) -> int:
    frames = encode_rollouts(group)
    return len(frames[0]) + sum(f.nbytes for f in frames[1:])


def sender(address: str, tokens: int, n_groups: int, pre_encode: bool) -> None:
    """Actor side, in its own process: wait for "go", then stream n_groups groups (encoded in the loop
    like the actor does, or pre-encoded to take the encode cost out)."""
    pool = make_groups(tokens, pool_size(tokens), seed=1)
    frames = [encode_rollouts(g) for g in pool] if pre_encode else None
    sock = ActorSocket(address)
    go, _ = sock.request(encode_control("ready"), timeout_s=60)
    assert go["t"] == "go"
    for i in range(n_groups):
        sock.send(frames[i % len(frames)] if frames else encode_rollouts(pool[i % len(pool)]))
    sock.request(encode_control("sent"), timeout_s=120)  # the receiver acks once every group is decoded
    sock.close()


def zmq_run(tokens: int, n_groups: int, pre_encode: bool = False) -> float:
    """Seconds for n_groups to travel and be fully decoded, measured on the receiver."""
    learner = LearnerSocket("127.0.0.1", 0, 256 << 20)
    proc = mp.get_context("spawn").Process(target=sender, args=(learner.address, tokens, n_groups, pre_encode))
    proc.start()
    try:
        got = learner.recv(120_000)
        assert got is not None, "sender did not connect"
        peer, frames = got
        assert decode_header(frames[0].buffer)["t"] == "ready"
        learner.send(peer, encode_control("go"))
        t0 = time.perf_counter()
        received = 0
        while received < n_groups:
            got = learner.recv(30_000)
            assert got is not None, f"timed out after {received} groups"
            _, frames = got
            head = decode_header(frames[0].buffer)
            group = decode_rollouts(head, frames[1:])
            assert len(group.completions) == K and len(group.completions[0].token_ids) == tokens
            received += 1
        elapsed = time.perf_counter() - t0
        got = learner.recv(30_000)
        assert got is not None and decode_header(got[1][0].buffer)["t"] == "sent"
        learner.send(got[0], encode_control("ack"))
        proc.join(30)
        return elapsed
    finally:
        if proc.is_alive():
            proc.kill()
        learner.close()


def memcpy_run(groups: list[RolloutGroup], n_groups: int) -> float:
    """Seconds to copy the frames of n_groups groups (pre-encoded) in this process."""
    encoded = [encode_rollouts(g) for g in groups]
    t0 = time.perf_counter()
    for i in range(n_groups):
        head, *arrays = encoded[i % len(encoded)]
        bytes(memoryview(head))
        for a in arrays:
            np.copy(a)
    return time.perf_counter() - t0


def codec_run(groups: list[RolloutGroup], n_groups: int) -> tuple[float, float]:
    """(encode seconds, decode seconds) per group, in-process, no socket."""
    t_enc = t_dec = 0.0
    for i in range(n_groups):
        t0 = time.perf_counter()
        frames = encode_rollouts(groups[i % len(groups)])
        t1 = time.perf_counter()
        # a numpy array's memoryview counts elements; zmq frames are bytes, so view the arrays as bytes
        decode_rollouts(decode_header(frames[0]), [memoryview(a).cast("B") for a in frames[1:]])
        t_dec += time.perf_counter() - t1
        t_enc += t1 - t0
    return t_enc / n_groups, t_dec / n_groups


def measure(tokens: int, n: int | None = None, repeats: int = REPEATS) -> dict:
    n = n or GROUPS[tokens]
    groups = make_groups(tokens, pool_size(tokens), seed=1)
    nbytes = statistics.mean(group_bytes(g) for g in groups)
    zmq_runs = [zmq_run(tokens, n) for _ in range(repeats)]
    pre_runs = [zmq_run(tokens, n, pre_encode=True) for _ in range(repeats)]
    mem_runs = [memcpy_run(groups, n) for _ in range(repeats)]
    enc, dec = min((codec_run(groups, min(n, 1000)) for _ in range(repeats)), key=sum)
    z, m, p = (statistics.median(x) for x in (zmq_runs, mem_runs, pre_runs))
    return {
        "tokens": tokens, "groups": n, "bytes_per_group": nbytes, "zmq_seconds": zmq_runs, "memcpy_seconds": mem_runs,
        "zmq_pre_encoded_seconds": pre_runs, "zmq_pre_encoded_mb_per_s": n * nbytes / p / 1e6,
        "zmq_groups_per_s": n / z, "zmq_rollouts_per_s": n * K / z, "zmq_mb_per_s": n * nbytes / z / 1e6,
        "memcpy_mb_per_s": n * nbytes / m / 1e6, "ratio": m / z,
        "encode_us_per_group": enc * 1e6, "decode_us_per_group": dec * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_out(ap, "transport.json")
    ap.add_argument("--tokens", default="512,4096", help="completion lengths, comma-separated")
    ap.add_argument("--groups", type=int, default=None, help="groups per repeat (default: about 1-2 GB a length)")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args()
    rows = [measure(int(t), args.groups, args.repeats) for t in args.tokens.split(",")]
    print(f"{'tokens':>7} {'KB/group':>9} {'groups/s':>9} {'rollouts/s':>11} {'zmq MB/s':>9} {'pre-enc MB/s':>13} "
          f"{'memcpy MB/s':>12} {'ratio':>6} {'enc us':>7} {'dec us':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['bytes_per_group'] / 1024:>9.1f} {r['zmq_groups_per_s']:>9.0f} "
              f"{r['zmq_rollouts_per_s']:>11.0f} {r['zmq_mb_per_s']:>9.0f} {r['zmq_pre_encoded_mb_per_s']:>13.0f} "
              f"{r['memcpy_mb_per_s']:>12.0f} "
              f"{r['ratio']:>6.3f} {r['encode_us_per_group']:>7.1f} {r['decode_us_per_group']:>7.1f}")
    big = max(rows, key=lambda r: r["tokens"])  # 4096 tokens unless --tokens says otherwise
    ok = bench.target(f"target: >= {TARGET_MBS:.0f} MB/s between two processes at {big['tokens']} tokens: "
                      f"{big['zmq_mb_per_s']:.0f} MB/s", big["zmq_mb_per_s"] >= TARGET_MBS)
    bench.write_json(args.out, {"rows": rows, "target_mb_per_s": TARGET_MBS, "pass": ok})


if __name__ == "__main__":
    main()
