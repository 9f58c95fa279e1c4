"""The rollout wire format: round trips, and every malformed message is a WireError, not a crash."""

import msgpack
import numpy as np
import pytest

from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.wire import SCHEMA_VERSION, WireError, decode_header, decode_rollouts, encode_control, encode_rollouts


def make_group(lens=(5, 0, 3)) -> RolloutGroup:
    rng = np.random.default_rng(0)
    comps = [Completion(rng.integers(0, 100, n, dtype=np.int32), rng.normal(size=n).astype(np.float32),
                        float(i % 2), "stop" if i else "length", "ok") for i, n in enumerate(lens)]
    return RolloutGroup(7, 42, np.arange(4, dtype=np.int32), comps, policy_version=3, actor_id="actor-1",
                        purpose="train", gen_seconds=0.5, extra={"k": 1})


def roundtrip(frames):
    wire = [bytes(memoryview(f)) for f in frames]  # what actually crosses the socket
    head = decode_header(wire[0])
    return decode_rollouts(head, wire[1:])


def test_rollout_roundtrip_keeps_every_field():
    g = make_group()
    back = roundtrip(encode_rollouts(g))
    assert (back.work_id, back.question_id, back.policy_version, back.actor_id, back.purpose) == (7, 42, 3, "actor-1", "train")
    assert back.extra == {"k": 1} and back.gen_seconds == 0.5
    np.testing.assert_array_equal(back.prompt_ids, g.prompt_ids)
    assert len(back.completions) == 3
    for a, b in zip(back.completions, g.completions):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert (a.reward, a.finish_reason, a.verify_status) == (b.reward, b.finish_reason, b.verify_status)


def test_arrays_travel_as_raw_frames_not_inside_msgpack():
    g = make_group((4096,))
    frames = encode_rollouts(g)
    assert len(frames) == 4
    assert len(frames[0]) < 512  # the header stays small whatever the rollout length
    assert memoryview(frames[2]).nbytes == 4096 * 4 and memoryview(frames[3]).nbytes == 4096 * 4


def test_control_roundtrip():
    head = decode_header(encode_control("work", version=5)[0])
    assert head["t"] == "work" and head["version"] == 5


@pytest.mark.parametrize("frame", [b"", b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"v": SCHEMA_VERSION}),
                                   msgpack.packb({"v": SCHEMA_VERSION + 1, "t": "work"}), b"\x00" * (2 << 20)])
def test_bad_headers_raise_wire_error(frame):
    with pytest.raises(WireError):
        decode_header(frame)


def _mutated(**changes):
    frames = [bytes(memoryview(f)) for f in encode_rollouts(make_group())]
    head = msgpack.unpackb(frames[0])
    head.update(changes)
    return head, frames[1:]


@pytest.mark.parametrize("changes", [
    {"lens": [5, 0, 4]},                 # frame sizes no longer match
    {"lens": [5, 0]},                    # list lengths disagree
    {"rewards": [0.0, 2.0, 1.0]},        # reward outside [0, 1]
    {"work_id": "7"},                    # wrong type
    {"policy_version": True},            # bool is not an int here
    {"purpose": "bogus"},
    {"lens": [5, -1, 4]},
])
def test_wrong_schema_fields_raise_wire_error(changes):
    head, frames = _mutated(**changes)
    with pytest.raises(WireError):
        decode_rollouts(head, frames)


def test_missing_or_truncated_frames_raise_wire_error():
    head, frames = _mutated()
    with pytest.raises(WireError):
        decode_rollouts(head, frames[:2])
    with pytest.raises(WireError):
        decode_rollouts(head, [frames[0], frames[1][:-3], frames[2]])
