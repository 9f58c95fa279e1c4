"""The five seams (exgrpo_async/seams.py): every concrete class has each member its Protocol names, with the
same parameters (and async where the Protocol's method is), and the attributes it declares; the actors reach
their engine through nothing else. Checked on the classes' source (no engine, socket or pool is started)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest

from actors.engine import AsyncVLLMEngine, VLLMEngine
from actors.verifier import MathVerifier
from exgrpo_async import seams
from exgrpo_async.rollout import RolloutGroup
from exgrpo_async.transport import ActorSocket, LearnerSocket
from exgrpo_async.weight_sync import WeightPublisher, WeightReceiver

ROOT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = [(seams.RolloutRecord, RolloutGroup), (seams.LearnerTransport, LearnerSocket),
                   (seams.ActorTransport, ActorSocket), (seams.BatchEngine, VLLMEngine),
                   (seams.StreamEngine, AsyncVLLMEngine), (seams.Verifier, MathVerifier),
                   (seams.WeightSender, WeightPublisher), (seams.WeightSource, WeightReceiver)]


def protocol_members(proto: type) -> tuple[dict[str, object], set[str]]:
    """The Protocol's methods (name -> function) and attributes, its bases' included."""
    methods, attributes = {}, set()
    for klass in reversed(proto.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False) or klass.__module__ != seams.__name__:
            continue
        methods.update({n: f for n, f in vars(klass).items() if inspect.isfunction(f) and not n.startswith("_")})
        attributes |= set(vars(klass).get("__annotations__", {}))
    return methods, attributes


def instance_attributes(cls: type) -> set[str]:
    """Attributes a class sets on `self` anywhere in its methods, its dataclass fields and properties."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names |= {n for n, v in vars(cls).items() if isinstance(v, property)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def mismatches(proto: type, cls: type) -> list[str]:
    methods, attributes = protocol_members(proto)
    bad = [f"no attribute {a}" for a in sorted(attributes - instance_attributes(cls))]
    for name, want in methods.items():
        got = getattr(cls, name, None)
        if got is None:
            bad.append(f"no method {name}")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
            bad.append(f"{name}: async in one and not the other")
        params = lambda f: [(p.name, p.kind, p.default is inspect.Parameter.empty)  # noqa: E731
                            for p in inspect.signature(f).parameters.values()]
        if params(want) != params(got):
            bad.append(f"{name}{inspect.signature(got)} is not {name}{inspect.signature(want)}")
    return bad


@pytest.mark.parametrize("proto,cls", IMPLEMENTATIONS, ids=[c.__name__ for _, c in IMPLEMENTATIONS])
def test_each_implementation_has_its_protocols_members(proto, cls):
    assert mismatches(proto, cls) == []


def test_the_check_sees_a_missing_or_different_member():
    class Partial:
        def __init__(self):
            self.tp = 1

        def get_tokenizer(self, extra):
            return None

        async def close(self) -> None:
            return None

    bad = mismatches(seams.BatchEngine, Partial)
    assert "no attribute policy_version" in bad and "no method generate" in bad
    assert any(b.startswith("get_tokenizer(") for b in bad) and "close: async in one and not the other" in bad


def test_the_actor_loops_reach_their_engine_only_through_its_protocol():
    """No `engine.llm` (vLLM's own object) in the loops: what they call is the seam's."""
    for name in ("loop.py", "stream_loop.py", "session.py", "evaluate.py"):
        source = (ROOT / "actors" / name).read_text()
        assert "engine.llm" not in source, name
