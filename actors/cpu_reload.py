"""CPU weight reload by pre-packed swap: new oneDNN handlers are built beside the live ones, then swapped in.

Why: on CPU vLLM keeps each linear layer's weight only inside a oneDNN handler (a re-packed copy) and
drops the plain tensor, so new weights go through vLLM's layerwise reload: restore every layer on the
meta device, materialise fresh tensors, run the weight loaders, re-pack, copy back. Measured on the
113M benchmark model that bookkeeping plus fresh allocations (page faults are slow on these VMs) cost
as much as the transfer itself, and it all had to run while the engine was stopped.

What this does instead (the "prepacked" reload; `actor.engine.cpu_weight_reload`):
- once, every linear layer whose weight vLLM dropped gets a persistent full-size shadow weight in its
  place (the forward pass never reads it: the oneDNN closure ignores its weight argument), and every
  embedding-like layer whose weight the forward does read gets a private staging copy;
- once per set of receive buffers, the model's own `load_weights` runs with recording loaders: it
  routes each received tensor (stacking q/k/v and gate/up, skipping a tied lm_head, whatever the model
  does) and we keep (loader, target, view into the receive buffer, shard arguments). Because the
  receiver reuses its buffers, replaying a record later loads whatever the newest broadcast put there;
- `stage(i)` (engine running) replays bucket i's records into shadows and staging copies and builds
  the new handler of every layer whose weights are complete, so packing overlaps the next bucket's
  transfer and, for in-flight updates, generation. A layer whose weights arrive back to back in the
  fused layout (the learner's bucket plan arranges that) is packed straight from the receive buffer,
  skipping its shadow copy;
- `commit()` (engine stopped) replays the few records that target live tensors (norms, biases),
  copies the staging embeddings into the live ones and swaps each layer's `cpu_linear`: a pointer swap.
Cost: a staging copy of the embedding-like layers, a shadow for each linear layer not packed straight
from the receive buffers (none with this project's learner), and a second set of packed weights while
a sync is staged.
Used only when every packed layer is oneDNN (vLLM's x86/Arm default); otherwise `PrepackedReload.build`
raises `Unsupported` and the worker keeps the layerwise reload.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors import vllm_surface

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """This model or build cannot use the pre-packed swap; the caller falls back to layerwise reload."""


@dataclass
class _Record:
    loader: Callable
    bound: inspect.BoundArguments  # the loader's arguments, "param" replaced by the target at replay
    target: torch.Tensor  # a shadow / staging copy, or a live tensor (replayed at commit)
    bucket: int


def _is_onednn(module: torch.nn.Module) -> bool:
    code = getattr(getattr(module, "cpu_linear", None), "__code__", None)
    return code is not None and "onednn_mm" in code.co_names


def _original_loader(tensor: torch.Tensor) -> Callable:
    loader = getattr(tensor, "weight_loader", None) or vllm_surface.default_weight_loader()
    while getattr(loader, "__name__", "") == "online_process_loader":  # a layerwise-reload wrapper
        loader = loader.__wrapped__
    return loader


def _twin(proto: torch.Tensor, layer: torch.nn.Module, data: torch.Tensor) -> torch.Tensor:
    """`data` dressed as `proto`: same class and attributes (weight loader, shard dims), loaders bound to
    `layer` (vLLM's reload metadata binds them to a sentinel) and unwrapped from layerwise wrappers."""
    from types import MethodType

    layer_ref_sentinel = vllm_surface.reload_sentinel()
    attrs = {}
    for key, value in proto.__dict__.items():
        while getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        if isinstance(value, MethodType) and value.__self__ is layer_ref_sentinel:
            value = value.__func__.__get__(layer)
        attrs[key] = value
    data.__class__ = proto.__class__
    data.__dict__ = attrs
    return data


def _within(t: torch.Tensor, bufs: list[torch.Tensor]) -> int:
    """Index of the receive buffer whose memory holds `t` (a view, not a copy), or -1."""
    p = t.data_ptr()
    for i, b in enumerate(bufs):
        if b.data_ptr() <= p and p + t.numel() * t.element_size() <= b.data_ptr() + b.numel() * b.element_size():
            return i
    return -1


class PrepackedReload:
    """Pre-packed weight swap for one vLLM model on CPU (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.packed = [m for m in model.modules() if hasattr(m, "cpu_linear")]
        if not self.packed:
            raise Unsupported("no CPU-packed layers")
        not_onednn = [type(m).__name__ for m in self.packed if not _is_onednn(m)]
        if not_onednn:
            raise Unsupported(f"layers not packed by oneDNN: {sorted(set(not_onednn))}")
        self._dropped: dict[torch.nn.Module, torch.nn.Parameter] = {}  # layer -> vLLM's empty weight
        self._shape: dict[int, torch.Size] = {}  # id(shadow) -> its full shape (a direct one is emptied)
        self.shadow: dict[int, torch.Tensor] = {}  # id(live or dropped weight) -> shadow / staging copy
        self.staging: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live weight, staging copy) copied at commit
        plans = []
        for m in self.packed:
            w = m.weight
            if w.numel() == 0:  # vLLM dropped it after packing: rebuild from the recorded metadata
                meta = vllm_surface.layerwise_info(m).restore_metadata[0].get("weight")
                if meta is None or meta.numel() == 0:
                    raise Unsupported(f"no restore metadata for {type(m).__name__}.weight")
                plans.append((m, w, meta))
            elif id(w) not in self.shadow:
                copy = _twin(w, m, w.detach().clone())  # the clone keeps padding rows (vocab padding)
                self.shadow[id(w)] = copy
                self.staging.append((w, copy))
        for m, w, meta in plans:  # only now touch the model: nothing above can fail half-way
            s = _twin(meta, m, torch.empty(meta.shape, dtype=meta.dtype))
            self._dropped[m] = w
            m.register_parameter("weight", s)  # the forward never reads it (oneDNN closure)
            self.shadow[id(s)] = s
            self._shape[id(s)] = meta.shape
        self._staged_ids = {id(t) for t in self.shadow.values()}
        self.records: list[_Record] = []
        self._bufs: list[int] = []
        self._built: dict[torch.nn.Module, Callable] = {}
        self._last_bucket: dict[int, int] = {}
        self.direct: dict[int, torch.Tensor] = {}  # id(shadow) -> its stretch of a receive buffer

    def counts(self) -> dict[str, int]:
        """Layers swapped, linear layers with a shadow, and those packed straight from the receive buffers."""
        return {"packed": len(self.packed), "linear": len(self._dropped), "direct": len(self.direct)}

    def undo(self) -> None:
        """Put vLLM's dropped weights back (before falling back to the layerwise reload)."""
        for m, w in self._dropped.items():
            m.register_parameter("weight", w)
        self._dropped.clear()

    def source(self, m: torch.nn.Module) -> torch.Tensor:
        return self.shadow[id(m.weight)]

    def recorded_for(self, bufs: list[torch.Tensor]) -> bool:
        return self._bufs == [b.data_ptr() for b in bufs]

    def record(self, buckets: list[list[tuple[str, torch.Tensor]]], bufs: list[torch.Tensor]) -> None:
        """Route one received broadcast through the model's own `load_weights` without loading anything,
        keeping what each loader was asked to do. Raises Unsupported if a loader got a copy, not a view."""
        for m in self._dropped:  # shadows emptied by an earlier `_find_direct` get their memory back
            if m.weight.numel() == 0:
                m.weight.data = torch.empty(self._shape[id(m.weight)], dtype=m.weight.dtype)
        params = {id(p): p for m in self.model.modules() for p in m.parameters(recurse=False)}
        params.update({id(b): b for m in self.model.modules() for b in m.buffers(recurse=False)})
        saved: dict[int, tuple[torch.Tensor, dict]] = {}
        records: list[_Record] = []

        def recorder(target: torch.Tensor, loader: Callable) -> Callable:
            sig = inspect.signature(loader)

            def record_call(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                loaded = bound.arguments.get("loaded_weight")
                bucket = _within(loaded, bufs) if isinstance(loaded, torch.Tensor) else -1
                if bucket < 0:
                    raise Unsupported(f"{type(target).__name__} loader got a tensor outside the receive buffers")
                records.append(_Record(loader, bound, self.shadow.get(id(bound.arguments["param"]), target), bucket))

            return record_call

        for t in params.values():
            saved[id(t)] = (t, dict(t.__dict__))
            t.weight_loader = recorder(t, _original_loader(t))
        try:
            for bucket in buckets:
                self.model.load_weights(weights=iter(bucket))
        finally:
            for t, attrs in saved.values():
                t.__dict__.clear()
                t.__dict__.update(attrs)
        loaded: dict[int, int] = {}
        for r in records:
            loaded[id(r.target)] = loaded.get(id(r.target), 0) + r.bound.arguments["loaded_weight"].numel()
        missing = [type(m).__name__ for m in self.packed if id(self.source(m)) not in loaded]
        partial = [type(m).__name__ for m in self._dropped if loaded.get(id(m.weight)) != m.weight.numel()]
        if missing or partial:  # e.g. a tensor-parallel shard, or names the model routes elsewhere
            raise Unsupported(f"the broadcast does not fill {sorted(set(missing + partial))}")
        self.records = records
        self._bufs = [b.data_ptr() for b in bufs]
        self._last_bucket = {}
        for r in records:
            self._last_bucket[id(r.target)] = max(self._last_bucket.get(id(r.target), -1), r.bucket)
        self.direct = self._find_direct(bufs)
        log.info("weight reload: pre-packed swap of %d layers, %d of %d linear layers packed straight from "
                 "the receive buffers", len(self.packed), len(self.direct), len(self._dropped))

    @torch.no_grad()
    def _find_direct(self, bufs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Shadows whose whole content lies, in layout, as one stretch of a receive buffer (the learner
        sends fused projections back to back: exgrpo_async.weight_sync.plan_buckets): those layers are
        re-packed straight from the buffer and their shadow copy is skipped. Proven, not assumed: the
        stretch must be exactly the loaded views, and the loaders' result must equal it bit for bit."""
        direct = {}
        for m in self._dropped:
            s = m.weight
            mine = [r for r in self.records if r.target is s]
            views = sorted((r.bound.arguments["loaded_weight"] for r in mine), key=lambda t: t.data_ptr())
            if len({r.bucket for r in mine}) != 1 or not all(v.is_contiguous() for v in views):
                continue
            if any(a.data_ptr() + a.numel() * a.element_size() != b.data_ptr() for a, b in zip(views, views[1:])):
                continue
            buf = bufs[mine[0].bucket]
            start = (views[0].data_ptr() - buf.data_ptr()) // buf.element_size()
            stretch = buf[start:start + s.numel()].view(s.shape)
            for r in mine:
                r.bound.arguments["param"] = s
                r.loader(*r.bound.args, **r.bound.kwargs)
            if torch.equal(s, stretch):
                direct[id(s)] = stretch
                s.data = torch.empty(0, dtype=s.dtype)  # never read again: give the memory back
        return direct

    def _is_staged(self, r: _Record) -> bool:
        return id(r.target) in self._staged_ids

    @torch.no_grad()
    def stage(self, bucket: int) -> None:
        """Load bucket `bucket` into the shadows and build the handlers it completes (engine may run)."""
        ops = vllm_surface.onednn_ops()
        for r in self.records:
            if r.bucket == bucket and self._is_staged(r) and id(r.target) not in self.direct:
                r.bound.arguments["param"] = r.target
                r.loader(*r.bound.args, **r.bound.kwargs)
        for m in self.packed:
            s = self.source(m)
            if self._last_bucket.get(id(s)) == bucket:
                s = self.direct.get(id(s), s)  # the stretch of the receive buffer, or the shadow
                handler = ops.create_onednn_mm(s.t(), 32)  # copies s into oneDNN's packed layout
                self._built[m] = lambda x, weight, bias, h=handler: ops.onednn_mm(h, x, bias)

    @torch.no_grad()
    def commit(self) -> None:
        """Make the staged weights live (engine stopped): small live tensors, embeddings, handler swap."""
        if len(self._built) != len(self.packed):
            raise RuntimeError(f"weight reload: {len(self._built)} of {len(self.packed)} layers staged")
        for r in self.records:
            if not self._is_staged(r):
                r.bound.arguments["param"] = r.target
                r.loader(*r.bound.args, **r.bound.kwargs)
        for live, copy in self.staging:
            live.copy_(copy)
        for m, linear in self._built.items():
            m.cpu_linear = linear
        self._built = {}
