"""WeightPublisher buffer reuse: a set being sent is never overwritten by a later publish."""

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
