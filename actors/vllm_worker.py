"""vLLM worker extension: receives the learner's weights inside each vLLM worker process.

vLLM mixes this class into its Worker (`worker_extension_cls`), and the actor calls its methods through
`collective_rpc`, so the same code runs in-process (CPU demo) and in vLLM's worker processes (GPU, TP>1).
Method names carry a `ws_` prefix because the Worker already owns names like `update_weights`.

Three CPU pitfalls are handled here (docs: cpu-vllm.md section 1):
- plain `model.load_weights` fails on CPU because linear layers are pre-packed for oneDNN; loading goes
  through vLLM's layerwise-reload lifecycle, which re-packs each layer once its weights are in;
- with tied embeddings the lm_head keeps its own pre-packed copy that reload does not refresh, so it
  is re-processed explicitly (without it, log-probs are off by ~29 nats);
- the prefix cache holds KV computed by old weights; the engine (not the worker) resets it after a sync.

Two ways in: `ws_recv` receives and loads in one call (the batch engine, idle between batches);
`ws_prefetch` + `ws_commit` split it for in-flight updates, so the engine only pauses for the load.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from exgrpo_async.weight_sync import Meta, WeightReceiver


class WeightSyncExtension:
    """Mixed into vLLM's Worker; `self.model_runner`, `self.device`, `self.rank` come from the Worker."""

    def ws_init(self, host: str, port: int, prefix: str, world_size: int, backend: str, timeout_s: float) -> bool:
        # reload warns on every sync that the tied lm_head and rotary buffers got no weights: expected
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        rank = 1 + int(getattr(self, "rank", 0))  # rank 0 is the learner
        device = torch.device("cpu") if backend == "gloo" else self.device
        self._ws = WeightReceiver(host, port, prefix, rank, world_size, backend, device, timeout_s)
        return True

    def ws_recv(self, meta: Meta) -> dict:
        """Receive a broadcast and load it at once (the engine is idle between two batches)."""
        t0 = time.perf_counter()
        self._load(self._ws.receive(meta))
        return {"seconds": time.perf_counter() - t0}

    def ws_prefetch(self, meta: Meta) -> bool:
        """Start receiving a broadcast in a background thread and return at once, so generation goes on
        while the bytes arrive (in-flight updates); `ws_commit` loads them once the engine is paused."""
        def receive() -> None:
            try:
                self._staged = list(self._ws.receive(meta))  # views into the receiver's persistent buffers
            except BaseException as e:  # surfaced by ws_commit
                self._staged = e

        self._staged = None
        self._prefetch = threading.Thread(target=receive, name="ws-prefetch", daemon=True)
        self._prefetch.start()
        return True

    def ws_prefetch_done(self) -> bool:
        """True once the prefetched broadcast has fully arrived (cheap: polled between engine steps)."""
        return not self._prefetch.is_alive()

    def ws_commit(self) -> dict:
        """Wait for the prefetched broadcast, then load it (call only while generation is paused)."""
        t0 = time.perf_counter()
        self._prefetch.join()
        waited = time.perf_counter() - t0
        staged, self._staged = self._staged, None
        if isinstance(staged, BaseException):
            raise RuntimeError(f"weight prefetch failed: {staged}") from staged
        self._load(iter(staged))
        return {"seconds": time.perf_counter() - t0, "waited": waited}

    def _load(self, buckets) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.model
        initialize_layerwise_reload(model)
        for bucket in buckets:
            model.load_weights(weights=bucket)
        finalize_layerwise_reload(model, self.model_runner.model_config)
        if self._ws.device.type == "cpu" and getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            qm = getattr(model.lm_head, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(model.lm_head)

    def ws_close(self) -> bool:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
            self._ws = None
        return True
