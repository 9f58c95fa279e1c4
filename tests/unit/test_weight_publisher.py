"""WeightPublisher buffer reuse: a set being sent is never overwritten by a later publish."""

import pytest
import torch

from exgrpo_async.weight_sync import WeightPublisher


def params(value: float):
    return [("a", torch.full((10,), value)), ("b", torch.full((3, 3), value))]


def test_checked_out_buffers_survive_later_publishes_and_are_reused_after_release():
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=5)
    pub.publish(1, params(1.0))
    v, meta, flat, token = pub.checkout()
    assert v == 1 and [n for n, _, _ in meta[0]] == ["a", "b"]
    pub.publish(2, params(2.0))
    pub.publish(3, params(3.0))  # the set holding version 1 is still checked out: must not be touched
    assert torch.all(flat[0] == 1.0)
    assert torch.all(pub.snapshot()[2][0] == 3.0)
    n_sets = len(pub._sets)
    pub.release(token)
    pub.publish(4, params(4.0))
    pub.publish(5, params(5.0))
    assert len(pub._sets) == n_sets  # no new allocation once sets are free again
    assert torch.all(pub.snapshot()[2][0] == 5.0) and pub.version == 5


def test_plan_buckets_keeps_fused_projections_back_to_back():
    """Each block's matrices come first and a block that fits is never split, so q/k/v (and gate/up) lie
    contiguous in one flat buffer: what the CPU pre-packed reload packs from without a copy."""
    from exgrpo_async.weight_sync import plan_buckets

    def block(i: int) -> list:
        p = f"model.layers.{i}.self_attn."
        return [(p + "q_proj.weight", torch.zeros(8, 4)), (p + "q_proj.bias", torch.zeros(8)),
                (p + "k_proj.weight", torch.zeros(4, 4)), (p + "k_proj.bias", torch.zeros(4)),
                (p + "v_proj.weight", torch.zeros(4, 4)), (p + "v_proj.bias", torch.zeros(4)),
                (p + "o_proj.weight", torch.zeros(4, 8))]

    named = [("model.embed_tokens.weight", torch.zeros(10, 4))] + block(0) + block(1)
    meta = plan_buckets(named, bucket_bytes=4 * (40 + 112 + 16))  # embed + one block fit, two do not
    names = [[n.removeprefix("model.layers.") for n, _, _ in b] for b in meta]
    assert names[0] == ["model.embed_tokens.weight", "0.self_attn.q_proj.weight", "0.self_attn.k_proj.weight",
                        "0.self_attn.v_proj.weight", "0.self_attn.o_proj.weight", "0.self_attn.q_proj.bias",
                        "0.self_attn.k_proj.bias", "0.self_attn.v_proj.bias"]
    assert [n.split(".")[0] for n in names[1]] == ["1"] * 7  # block 1 starts a bucket rather than splitting
    assert sorted(n for b in meta for n, _, _ in b) == sorted(n for n, _ in named)


def test_publish_casts_fp32_master_weights_to_the_actors_dtype():
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=5)
    named = [("model.layers.0.mlp.up_proj.weight", torch.full((4, 3), 1.0 + 2**-12)),
             ("model.layers.0.mlp.up_proj.bias", torch.full((4,), -0.5))]
    pub.publish(1, named, torch.bfloat16)
    version, meta, flat = pub.snapshot()
    assert {d for b in meta for _, d, _ in b} == {"bfloat16"} and all(t.dtype == torch.bfloat16 for t in flat)
    assert flat[0][:12].float().tolist() == [1.0] * 12  # 1 + 2**-12 rounds to 1 in bf16


def _receiver(pub: WeightPublisher, key: str, ring: bool = False):
    """A rank-1 receiver joined to `key`'s group, built in a thread beside the publisher's open_group."""
    import threading

    from exgrpo_async.weight_sync import WeightReceiver

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("rx", WeightReceiver(
        "127.0.0.1", pub.port, f"ws/{key}/", 1, 2, "gloo", torch.device("cpu"), 5, ring=ring)))
    t.start()
    pub.open_group(key, 2)
    t.join(10)
    return out["rx"]


def test_gpu_style_receiver_never_rewrites_a_bucket_the_loader_still_holds():
    """`ring=True` (the GPU receiver) with a loader that keeps every bucket's views to the end, as vLLM's
    layerwise reload keeps a fused layer's first tensors until its last one arrives: each view still
    holds what was sent (a receiver rotating two buffers would have written bucket i+2 over bucket i)."""
    import threading
    import time

    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=5)
    pub.bucket_bytes = 4 * 64  # five buckets of at most 64 floats
    g = torch.Generator().manual_seed(0)
    named = [(f"layer.{i}.w", torch.randn(8, 8, generator=g)) for i in range(4)] + [("half", torch.randn(6).bfloat16())]
    pub.publish(1, named)
    _, meta, flat = pub.snapshot()
    rx = _receiver(pub, "r", ring=True)
    for keep in (False, True):
        sender = threading.Thread(target=pub.send, args=("r", flat))
        sender.start()
        got = {}
        for bucket in rx.receive(meta, keep=keep):
            time.sleep(0.05)  # a slow load: the next buckets land meanwhile
            got.update(bucket)  # views, not copies
        sender.join(10)
        assert got.keys() == dict(named).keys() and all(torch.equal(got[n], t) for n, t in named)
        assert rx.buffers == []  # no buffers kept between syncs
    rx.close()
    pub.close_group("r")


def test_a_group_whose_handshake_never_completes_is_aborted_at_the_deadline():
    """NCCL forms a communicator inside the first collective and blocks there until every rank comes:
    `warm_up` runs that first broadcast in a helper thread and gives up at the deadline, aborting the group."""
    import threading
    import time

    import pytest

    from exgrpo_async.weight_sync import SyncTimeout, warm_up

    class Handshake:  # a group whose first collective blocks its caller until abort()
        def __init__(self):
            self.aborted = threading.Event()

        def broadcast(self, tensors, opts):
            self.aborted.wait(30)
            raise RuntimeError("aborted")

        def abort(self):
            self.aborted.set()

    pg = Handshake()
    t0 = time.monotonic()
    with pytest.raises(SyncTimeout, match="never joined"):
        warm_up(pg, torch.device("cpu"), 0.5)
    assert 0.5 <= time.monotonic() - t0 < 3 and pg.aborted.wait(2)


def test_a_broadcast_the_peer_never_takes_times_out_and_aborts_only_its_group():
    """A frozen actor's worker never posts its receive: `send` gives up after `timeout_s` with SyncTimeout
    (no device-wide wait, no hang), drops that group, and another actor's group still works."""
    import threading
    import time

    import pytest

    from exgrpo_async.weight_sync import SyncTimeout

    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=5)
    pub.publish(1, [("w", torch.randn(4 << 20))])  # 16 MB: more than the socket buffers take unread
    _, meta, flat = pub.snapshot()
    frozen, live = _receiver(pub, "frozen"), _receiver(pub, "live")
    pub.timeout_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(SyncTimeout):
        pub.send("frozen", flat)
    assert time.monotonic() - t0 < 4 and "frozen" not in pub.groups
    sender = threading.Thread(target=pub.send, args=("live", flat))
    sender.start()
    got = [t.clone() for bucket in live.receive(meta) for _, t in bucket]
    sender.join(10)
    assert torch.equal(got[0], flat[0])
    live.close()
    frozen.close()
    pub.close_group("live")


def test_one_set_is_repacked_in_place_once_its_send_lets_go():
    """`max_sets=1` (the GPU default: the lead holds one packed copy of a 7B model, not two): a publish
    while a send holds the set waits for its release instead of allocating, then repacks in place."""
    import threading
    import time

    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=5, max_sets=1)
    pub.publish(1, params(1.0))
    v, _, flat, token = pub.checkout()
    done = threading.Event()
    publisher = threading.Thread(target=lambda: (pub.publish(2, params(2.0)), done.set()))
    publisher.start()
    time.sleep(0.5)
    assert not done.is_set() and torch.all(flat[0] == 1.0)  # the send's version is untouched meanwhile
    pub.release(token)
    assert done.wait(5)
    publisher.join()
    assert len(pub._sets) == 1 and pub.version == 2 and torch.all(pub.snapshot()[2][0] == 2.0)
    v, _, flat2, token = pub.checkout()  # the next send gets the new version, from the same buffers
    assert v == 2 and flat2[0].data_ptr() == flat[0].data_ptr()
    pub.release(token)


def test_a_publish_gives_up_on_a_set_held_past_twice_the_send_deadline():
    from exgrpo_async.weight_sync import SyncTimeout

    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=0.2, max_sets=2)
    pub.publish(1, params(1.0))
    held = [pub.checkout()[3]]
    pub.publish(2, params(2.0))  # the second set: allowed
    held.append(pub.checkout()[3])
    with pytest.raises(SyncTimeout, match="still held by a send"):
        pub.publish(3, params(3.0))
    assert len(pub._sets) == 2


def test_max_sets_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=1, max_sets=0)
