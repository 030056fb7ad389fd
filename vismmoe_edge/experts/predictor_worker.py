"""The lookahead predictor beside compute instead of on its critical path.

At each MoE layer compute hands over the layer's routing and hidden state and goes on: on CUDA the hidden state
is copied to pinned host memory asynchronously, behind the layer's kernels. A worker thread waits for the copy,
runs the predictor (onnxruntime releases the GIL while it runs) and queues the predicted experts, which the
pipeline fetches only behind demand misses and within the speculative cap. Only the newest layer's request is
kept: a prediction for a layer compute has already passed is worthless.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from vismmoe_edge.experts.pipeline import ExpertPipeline


class PredictorWorker:
    def __init__(self, predictor: Any, pipeline: ExpertPipeline) -> None:
        self.predictor = predictor
        self.pipeline = pipeline
        self.seconds = 0.0  # predictor time, off the critical path
        self.handoff_seconds = 0.0  # what compute spent handing work over: the critical-path cost
        self.calls = 0
        self._job: tuple[int, torch.Tensor, torch.Tensor, torch.cuda.Event | None] | None = None
        self._lock = threading.Condition()
        self._closed = False
        # Two pinned buffers per shape, alternated. A worker slower than two layers may read a buffer being
        # rewritten: a worse guess, never a wrong token (predictions only order prefetches).
        self._staging: dict[tuple[int, ...], torch.Tensor] = {}
        self._flip = 0
        self._thread = threading.Thread(target=self._loop, name="vismmoe-predictor", daemon=True)
        self._thread.start()

    def submit(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        start = time.perf_counter()
        event = None
        if hidden.device.type == "cuda":
            host = self._pinned_like(hidden)
            host.copy_(hidden, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            hidden = host
        job = (layer, hidden, top_k_index.cpu(), event)
        with self._lock:
            self._job = job  # replaces an older request nobody has taken yet
            self._lock.notify()
        self.handoff_seconds += time.perf_counter() - start

    def _pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        key = tuple(t.shape)
        pair = self._staging.get(key)
        if pair is None:
            pair = self._staging[key] = torch.empty((2, *t.shape), dtype=t.dtype, pin_memory=True)
        self._flip ^= 1
        return pair[self._flip]

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                layer, hidden, index, event = self._job  # type: ignore[misc]
                self._job = None
            if event is not None:
                event.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                requests = self.predictor.predict(layer, hidden, index)
            self.pipeline.prefetch(requests, current_layer=layer)
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=5)
