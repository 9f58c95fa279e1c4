"""The five seams between the system's parts, as Protocols: what one side may ask of the other, and no more.

docs/architecture.md, "The five interfaces", says what travels across each; here is what code may call:
1. the rollout record: `RolloutRecord`, what the learner reads of an actor's group (`rollout.RolloutGroup`);
2. the rollout transport: `LearnerTransport` (the learner's one socket) and `ActorTransport` (an actor's);
3. the generation engine: `Engine` (weights, version, tokenizer, close) and its two kinds, `BatchEngine`
   (vLLM's LLM, actors/loop.py) and `StreamEngine` (vLLM's AsyncLLM, actors/stream_loop.py);
4. the verifier: `Verifier` (actors/verifier.py, math-verify or your own function in the same pool);
5. weight sync: `WeightSender` (the learner's publisher) and `WeightSource` (an actor's receiver).
A new transport, engine or verifier implements its Protocol; tests/unit/test_seams.py checks that every
concrete class in the repository has each member its Protocol names, with the same parameters.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np


class RolloutRecord(Protocol):
    """One question's completions from one work item, as the learner reads them."""

    work_id: int
    question_id: int
    prompt_ids: np.ndarray
    completions: list
    policy_version: int
    actor_id: str
    purpose: str
    gen_seconds: float
    extra: dict


class LearnerTransport(Protocol):
    """The learner's end: every actor's messages in, replies to one actor out."""

    def recv(self, timeout_ms: int) -> tuple[bytes, list] | None: ...
    def send(self, peer: bytes, frames: list) -> None: ...
    def close(self) -> None: ...


class ActorTransport(Protocol):
    """An actor's end: messages to the learner, and requests that wait for its reply."""

    def send(self, frames: list) -> None: ...
    def request(self, frames: list, timeout_s: float) -> tuple[dict, list]: ...
    def close(self) -> None: ...


class Engine(Protocol):
    """What both actor loops ask of their generation engine, besides generating."""

    tp: int  # weight-sync workers (the group's ranks 1..tp)
    policy_version: int  # the version its weights are; -1 until the first load
    fingerprint: dict[str, int] | None  # of the last load, when the learner asked for one

    def get_tokenizer(self) -> Any: ...


class BatchEngine(Engine, Protocol):
    """vLLM's LLM: a batch at a time; weights change between batches."""

    def generate(self, prompts: list[str], n: int, temperature: float, max_tokens: int,
                 seeds: list[int | None] | None = None) -> list[tuple[np.ndarray, list]]: ...
    def init_weight_sync(self, host: str, port: int, prefix: str, world_size: int, backend: str,
                         timeout_s: float) -> None: ...
    def load_weights(self, meta: list, version: int, fingerprint: bool = False, corrupt: bool = False) -> float: ...
    def close_weight_sync(self) -> None: ...
    def close(self) -> None: ...


class StreamEngine(Engine, Protocol):
    """vLLM's AsyncLLM: groups generate continuously; weights change in flight."""

    async def generate_group(self, prompt: str, n: int, temperature: float, max_tokens: int,
                             seed: int | None = None) -> tuple[np.ndarray, list]: ...
    async def init_weight_sync(self, host: str, port: int, prefix: str, world_size: int, backend: str,
                               timeout_s: float) -> None: ...
    async def load_weights(self, meta: list, version: int, fingerprint: bool = False,
                           corrupt: bool = False) -> float: ...
    async def update_in_flight(self, meta: list, version: int, mode: str, fingerprint: bool = False,
                               corrupt: bool = False) -> dict: ...
    async def close_weight_sync(self) -> None: ...
    async def close(self) -> None: ...


class Verifier(Protocol):
    """Scores (completion, answer) pairs: a reward in [0, 1] and a status ("ok", "timeout", "error")."""

    def score(self, items: list[tuple[str, str]], rows: list[dict] | None = None) -> list[tuple[float, str]]: ...
    def close(self) -> None: ...


class WeightSender(Protocol):
    """The learner's side: pack a version, hand it to each actor's group, open and close the groups."""

    host: str  # where the actors' workers find the groups' store
    port: int
    version: int  # the newest packed version

    def publish(self, version: int, named: list, dtype: Any = None) -> None: ...
    def snapshot(self) -> tuple[int, list, list]: ...
    def checkout(self) -> tuple[int, list, list, int]: ...
    def release(self, token: int) -> None: ...
    def fingerprint(self, version: int, meta: list, flat: list) -> dict[str, int]: ...
    def expected_fingerprint(self, version: int) -> dict[str, int] | None: ...
    def open_group(self, key: str, world_size: int) -> None: ...
    def send(self, key: str, flat: list) -> float: ...
    def close_group(self, key: str, abort: bool = False) -> None: ...


class WeightSource(Protocol):
    """An actor worker's side: the buckets of one version, as (name, tensor) lists."""

    def receive(self, meta: list, keep: bool = False) -> Iterator[list]: ...
    def close(self) -> None: ...
