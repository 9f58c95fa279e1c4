"""Wire format between actors and the learner: msgpack headers, raw array frames, never pickle.

Every message is a ZeroMQ multipart message whose first frame is a small msgpack map carrying
`v` (SCHEMA_VERSION) and `t` (the message type). Control messages are that one frame. A rollout group
adds three raw frames, so token ids and log-probs are never copied into msgpack:

    [header, prompt_ids int32, all completion token ids int32 (concatenated), all logprobs float32]

Decoding validates everything a peer could get wrong (schema version, types, frame count and sizes)
and raises `WireError`; the learner counts and drops such messages instead of crashing.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from exgrpo_async.rollout import Completion, RolloutGroup

SCHEMA_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # headers are small; anything bigger is hostile or a bug


class WireError(ValueError):
    """A message that cannot be decoded; the reason says what was wrong."""


def encode_control(msg_type: str, **fields: Any) -> list[bytes]:
    return [msgpack.packb({"v": SCHEMA_VERSION, "t": msg_type, **fields}, use_bin_type=True)]


def decode_header(frame: bytes | memoryview) -> dict:
    """Decode and check the first frame of any message."""
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(head, dict):
        raise WireError("header is not a map")
    if head.get("v") != SCHEMA_VERSION:
        raise WireError(f"schema version {head.get('v')!r}, expected {SCHEMA_VERSION}")
    if not isinstance(head.get("t"), str):
        raise WireError("header has no message type")
    return head


def encode_rollouts(group: RolloutGroup) -> list[Any]:
    """Frames for one group. The array frames are the numpy buffers themselves (zero-copy send)."""
    comps = group.completions
    head = {
        "v": SCHEMA_VERSION, "t": "rollouts", "work_id": group.work_id, "question_id": group.question_id,
        "policy_version": group.policy_version, "actor_id": group.actor_id, "purpose": group.purpose,
        "gen_seconds": float(group.gen_seconds), "extra": group.extra,
        "lens": [len(c.token_ids) for c in comps], "rewards": [float(c.reward) for c in comps],
        "finish": [c.finish_reason for c in comps], "verify": [c.verify_status for c in comps],
    }
    ids = np.ascontiguousarray(np.concatenate([c.token_ids for c in comps]) if comps else np.zeros(0), dtype=np.int32)
    lps = np.ascontiguousarray(np.concatenate([c.logprobs for c in comps]) if comps else np.zeros(0), dtype=np.float32)
    prompt = np.ascontiguousarray(group.prompt_ids, dtype=np.int32)
    return [msgpack.packb(head, use_bin_type=True), prompt, ids, lps]


def _field(head: dict, key: str, typ: type | tuple[type, ...]) -> Any:
    val = head.get(key)
    if not isinstance(val, typ) or isinstance(val, bool) and typ is int:
        raise WireError(f"field {key!r} is {type(val).__name__}, expected {typ}")
    return val


def decode_rollouts(head: dict, frames: list) -> RolloutGroup:
    """Rebuild a group from an already-decoded header and its three array frames."""
    if len(frames) != 3:
        raise WireError(f"rollouts message has {len(frames) + 1} frames, expected 4")
    lens = _field(head, "lens", list)
    n = len(lens)
    rewards, finish, verify = (_field(head, k, list) for k in ("rewards", "finish", "verify"))
    if not (len(rewards) == len(finish) == len(verify) == n):
        raise WireError("per-completion lists have different lengths")
    if not all(isinstance(x, int) and x >= 0 for x in lens):
        raise WireError("completion lengths must be non-negative ints")
    if not all(isinstance(r, (int, float)) and 0.0 <= r <= 1.0 for r in rewards):
        raise WireError("rewards must be numbers in [0, 1]")
    total = sum(lens)
    prompt_b, ids_b, lps_b = (memoryview(f).cast("B") for f in frames)  # byte views, whatever the source
    if len(prompt_b) % 4 or len(ids_b) != 4 * total or len(lps_b) != 4 * total:
        raise WireError(f"array frame sizes {len(prompt_b)}/{len(ids_b)}/{len(lps_b)} do not match lens (sum {total})")
    prompt = np.frombuffer(prompt_b, dtype=np.int32)
    ids = np.frombuffer(ids_b, dtype=np.int32)
    lps = np.frombuffer(lps_b, dtype=np.float32)
    comps, off = [], 0
    for i, n_tok in enumerate(lens):
        comps.append(Completion(ids[off:off + n_tok], lps[off:off + n_tok], float(rewards[i]),
                                str(finish[i]), str(verify[i])))
        off += n_tok
    purpose = _field(head, "purpose", str)
    if purpose not in ("train", "eval"):
        raise WireError(f"unknown purpose {purpose!r}")
    extra = head.get("extra", {})
    if not isinstance(extra, dict):
        raise WireError("extra must be a map")
    return RolloutGroup(
        work_id=_field(head, "work_id", int), question_id=_field(head, "question_id", int), prompt_ids=prompt,
        completions=comps, policy_version=_field(head, "policy_version", int),
        actor_id=_field(head, "actor_id", str), purpose=purpose,
        gen_seconds=float(_field(head, "gen_seconds", (int, float))), extra=extra,
    )
