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
"""

from __future__ import annotations

import logging
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
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        model = self.model_runner.model
        initialize_layerwise_reload(model)
        for bucket in self._ws.receive(meta):
            model.load_weights(weights=bucket)
        finalize_layerwise_reload(model, self.model_runner.model_config)
        if self._ws.device.type == "cpu" and getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            qm = getattr(model.lm_head, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(model.lm_head)
        return {"seconds": time.perf_counter() - t0}

    def ws_close(self) -> bool:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
            self._ws = None
        return True
