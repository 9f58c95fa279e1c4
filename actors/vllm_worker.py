"""vLLM worker extension: receives the learner's weights inside each vLLM worker process.

vLLM mixes this class into its Worker (`worker_extension_cls`), and the actor calls its methods through
`collective_rpc`, so the same code runs in-process (CPU demo) and in vLLM's worker processes (GPU, TP>1).
Method names carry a `ws_` prefix because the Worker already owns names like `update_weights`.

Three CPU pitfalls are handled here (docs: cpu-vllm.md section 1):
- plain `model.load_weights` fails on CPU because linear layers are pre-packed for oneDNN. By default
  (`cpu_weight_reload="prepacked"`, actors/cpu_reload.py) new handlers are built from shadow weights
  while the broadcast arrives and swapped in at commit; "layerwise", and any model the swap cannot
  handle, goes through vLLM's layerwise-reload lifecycle, which re-packs each layer once its weights are in;
- with tied embeddings the lm_head keeps its own pre-packed copy that reload does not refresh, so it
  is re-processed explicitly (without it, log-probs are off by ~29 nats); the swap re-packs it too;
- the prefix cache holds KV computed by old weights; the engine (not the worker) resets it after a sync.

Two ways in: `ws_recv` receives and loads in one call (the batch engine, idle between batches);
`ws_prefetch` + `ws_commit` split it for in-flight updates, so the engine only pauses for the load.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from actors import vllm_surface
from actors.cpu_reload import PrepackedReload, Unsupported
from exgrpo_async.weight_sync import Meta, WeightReceiver

log = logging.getLogger(__name__)


def serial_receive(backend: str, world_size: int) -> bool:
    """Whether an engine must not receive weights while it generates: NCCL with tensor parallelism (the
    learner and two or more workers in the weight-sync group)."""
    return backend == "nccl" and world_size > 2


class WeightSyncExtension:
    """Mixed into vLLM's Worker; `self.model_runner`, `self.device`, `self.rank` and `get_model` come from
    the Worker (actors/vllm_surface.py holds every vLLM internal used here)."""

    def ws_init(self, host: str, port: int, prefix: str, world_size: int, backend: str, timeout_s: float,
                cpu_reload: str = "prepacked") -> bool:
        if cpu_reload not in ("prepacked", "layerwise"):
            raise ValueError(f"cpu_weight_reload must be prepacked or layerwise, not {cpu_reload!r}")
        # on GPU there is nothing to re-pack: the layerwise reload is a device copy; a tensor-parallel
        # worker's loaders take its shard of each tensor, which the swap's records do not follow
        if backend != "gloo" or world_size > 2 or getattr(self, "_reload_mode", None) == "layerwise":
            cpu_reload = "layerwise"  # (a fallback once taken stays: the swap's shadows were removed)
        self._reload_mode, self._ws_world = cpu_reload, world_size
        self._prepacked_reload = getattr(self, "_prepacked_reload", None)  # kept across rejoins
        # reload warns on every sync that the tied lm_head and rotary buffers got no weights: expected
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        rank = 1 + int(getattr(self, "rank", 0))  # rank 0 is the learner
        device = torch.device("cpu") if backend == "gloo" else self.device
        # on GPU a fresh buffer per bucket (freed once loaded), not a copy of the model
        self._ws = WeightReceiver(host, port, prefix, rank, world_size, backend, device, timeout_s, ring=backend != "gloo")
        # a tensor-parallel GPU engine's workers all-reduce on their own NCCL communicator while they
        # generate; receiving on a second one at the same time can deadlock (NCCL's documentation on
        # concurrent communicators): such an engine receives only while paused, in `ws_commit`
        self._serial = serial_receive(backend, world_size)
        return True

    def ws_recv(self, meta: Meta, fingerprint: bool = False, corrupt: bool = False) -> dict:
        """Receive a broadcast and load it at once (the engine is idle between two batches); with
        `fingerprint`, fingerprint what was loaded (`corrupt`: the fault drill first)."""
        t0 = time.perf_counter()
        self._apply(self._receive(meta, lazy=True))
        return {"seconds": time.perf_counter() - t0, "reload": self._reload_mode, **self._after_load(fingerprint, corrupt)}

    def _after_load(self, fingerprint: bool, corrupt: bool) -> dict:
        if corrupt:
            self.ws_fault_corrupt()
        return {"fingerprint": self.ws_fingerprint() if fingerprint else None}

    def ws_prefetch(self, meta: Meta) -> bool:
        """Start receiving a broadcast in a background thread and return at once, so generation goes on
        while the bytes arrive (in-flight updates); `ws_commit` loads them once the engine is paused."""
        def receive() -> None:
            try:
                self._staged = self._receive(meta, lazy=False)
            except BaseException as e:  # surfaced by ws_commit
                self._staged = e

        self._staged = None
        self._prefetch = threading.Thread(target=receive, name="ws-prefetch", daemon=True)
        if not self._serial:  # a serial engine receives in ws_commit, generation paused (see ws_init)
            self._prefetch.start()
        return True

    def ws_prefetch_done(self) -> bool:
        """True once the prefetched broadcast has fully arrived and, with the prepacked reload, is staged
        (cheap: polled between engine steps)."""
        return not self._prefetch.is_alive()  # a deferred receive's thread never started: done at once

    def ws_commit(self, fingerprint: bool = False, corrupt: bool = False) -> dict:
        """Wait for the prefetched broadcast (or, for a serial engine, receive it now), then load it (call
        only while generation is paused); the fingerprint, if asked for, is taken before generation
        resumes."""
        t0 = time.perf_counter()
        if self._serial:
            self._prefetch.run()  # the receive, in this thread, with nothing else on the GPU
        else:
            self._prefetch.join()
        waited = time.perf_counter() - t0
        staged, self._staged = self._staged, None
        if isinstance(staged, BaseException):
            raise RuntimeError(f"weight prefetch failed: {staged}") from staged
        self._apply(staged)
        return {"seconds": time.perf_counter() - t0, "waited": waited, "reload": self._reload_mode,
                **self._after_load(fingerprint, corrupt)}

    def _prepacked(self) -> PrepackedReload | None:
        if self._reload_mode != "prepacked":
            return None
        if self._prepacked_reload is None:
            try:
                self._prepacked_reload = PrepackedReload(vllm_surface.worker_model(self))
            except Unsupported as e:
                self._fall_back(str(e))
        return self._prepacked_reload

    def _fall_back(self, why: str) -> None:
        log.warning("weight reload: pre-packed swap not possible (%s); using vLLM's layerwise reload", why)
        if self._prepacked_reload is not None:
            self._prepacked_reload.undo()
        self._prepacked_reload, self._reload_mode = None, "layerwise"

    def _receive(self, meta: Meta, lazy: bool):
        """Receive a broadcast. With the swap ready for these receive buffers, each bucket is staged (loaded
        into shadows, its completed layers re-packed) while the next one is in flight, and the swap is
        returned; otherwise the buckets (views into the receive buffers): a lazy iterator or a list."""
        buckets = self._ws.receive(meta, keep=not lazy)
        fast = self._prepacked()
        if fast is None:
            return buckets if lazy else list(buckets)
        rest = []
        for i, bucket in enumerate(buckets):
            if not rest and fast.recorded_for(self._ws.buffers):
                fast.stage(i)
            else:
                rest.append(bucket)
        return rest or fast

    def _apply(self, received) -> None:
        """Make received weights live (generation stopped): commit a staged swap, or load the buckets."""
        if isinstance(received, PrepackedReload):
            received.commit()
            return
        fast = self._prepacked()
        if fast is not None:  # first sync, or new receive buffers: route the broadcast once, then swap
            received = list(received)
            try:
                fast.record(received, self._ws.buffers)
            except Unsupported as e:
                self._fall_back(str(e))
            else:
                for i in range(len(received)):
                    fast.stage(i)
                fast.commit()
                return
        self._load_layerwise(received)

    def _load_layerwise(self, buckets) -> None:
        model = vllm_surface.worker_model(self)
        vllm_surface.layerwise_reload(model, self.model_runner.model_config, buckets)
        if self._ws.device.type == "cpu" and getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            qm = getattr(model.lm_head, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(model.lm_head)

    def ws_fingerprint(self) -> dict[str, int] | None:
        """This worker's share of the fingerprint of the weights the model computes with now
        (actors/fingerprint.py: the engine's is the workers' shares combined)."""
        if getattr(self, "_ws", None) is None:
            return None
        from actors.fingerprint import engine_fingerprint

        return engine_fingerprint(vllm_surface.worker_model(self))

    @torch.no_grad()
    def ws_fault_corrupt(self) -> bool:
        """Fault drill (actor.fault_corrupt_load_at_syncs): change one weight after a load, as a loader
        that skipped a tensor would leave it, so the fingerprint check has something to catch."""
        norm = dict(vllm_surface.worker_model(self).named_parameters())["model.norm.weight"]
        norm.data[0] += 1.0
        return True

    def ws_close(self) -> bool:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
            self._ws = None
        return True
