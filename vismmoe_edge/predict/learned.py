"""The learned lookahead predictor at run time: at every MoE layer, score the experts of the next W layers from
the routing so far, the pooled hidden state and the visual summary, and hand the top-B of each to the pipeline.

The scores come from an ONNX export (onnxruntime, CUDA provider where it exists) or, failing that, torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vismmoe_edge.experts.pipeline import ExpertKey
from vismmoe_edge.predict.routing_features import history_matrix, pooled_hidden, routing_shares
from vismmoe_edge.step_context import StepContext


class LearnedPredictor:
    name = "learned"

    def __init__(
        self,
        session: Any,
        meta: dict[str, Any],
        context: StepContext,
        *,
        top_b: int | None = None,
        min_score: float = 0.5,
    ) -> None:
        self.session = session  # .run(history, hidden, visual, layer_onehot) -> scores; .provider
        self.context = context  # interest_rows and visual_summary change at the compression cut
        self.layers: list[int] = list(context.moe_layers)
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = int(meta["num_experts"])
        self.window = int(meta["window"])
        self.depth = int(meta["history"])
        self.form = str(meta["form"])
        self.gamma = float(meta.get("gamma", 0.8))
        self.top_b = int(top_b if top_b is not None else meta.get("top_b", 20))
        self.hidden_dim = int(meta["hidden_dim"])
        # Only experts the model thinks likelier than this are fetched: a wrong guess costs bandwidth that demand
        # misses then wait behind, and can evict an expert that was needed (0.5 against 0: 5.04 against 4.22
        # tok/s in docs/benchmarks.md's unified replay run).
        self.min_score = min_score
        if int(meta["num_layers"]) != len(self.layers) or self.num_experts != context.num_experts:
            raise ValueError(
                f"the predictor was trained for {meta['num_layers']} MoE layers x {meta['num_experts']} experts, "
                f"the model has {len(self.layers)} x {context.num_experts}"
            )
        self.shares: dict[int, torch.Tensor] = {}
        self.calls = 0
        self.seconds = 0.0

    @property
    def provider(self) -> str:
        return str(self.session.provider)

    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor) -> None:
        """A route hook: this step's routing shares so far (a step restarts at the first MoE layer)."""
        i = self.position[layer]
        if i == 0:
            self.shares = {}
        self.shares[i] = routing_shares(top_k_index, self.context.interest_rows, self.num_experts)

    def features(self, layer: int, hidden: torch.Tensor) -> tuple[np.ndarray, ...]:
        i = self.position[layer]
        history = history_matrix(self.shares, i, self.num_experts, self.depth).reshape(1, -1)
        pooled = pooled_hidden(hidden, self.context.interest_rows).reshape(1, -1)
        visual = self.context.visual_summary
        visual = visual.reshape(1, -1).cpu() if visual is not None else torch.zeros_like(pooled)
        if self.hidden_dim == 0:  # a routing-history-only predictor
            pooled, visual = pooled[:, :0], visual[:, :0]
        onehot = torch.zeros(1, len(self.layers))
        onehot[0, i] = 1.0
        return tuple(t.numpy().astype(np.float32) for t in (history, pooled, visual, onehot))

    @torch.no_grad()
    def predict(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> list[tuple[ExpertKey, float]]:
        i = self.position[layer]
        if i + 1 >= len(self.layers):
            return []
        scores = np.asarray(self.session.run(*self.features(layer, hidden)))[0]
        self.calls += 1
        requests: list[tuple[ExpertKey, float]] = []
        for w in range(min(self.window, len(self.layers) - i - 1)):
            # window form: one score per expert index for the whole window, decayed with distance like its target
            row = scores[w] if self.form == "per_layer" else scores * self.gamma**w
            best = np.argsort(-row, kind="stable")[: self.top_b]
            requests += [((self.layers[i + 1 + w], int(e)), float(row[e])) for e in best if row[e] >= self.min_score]
        return requests
