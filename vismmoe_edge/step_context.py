"""The contract between the engine and what observes a step (predictors, calibration, telemetry).

The engine writes it as a step runs; observers only read it. It is built from the checkpoint before the
engine exists, so a predictor can be made first and handed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    moe_layers: list[int]  # decoder-layer indices that have routed experts, ascending
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts routed per token
    # The rows of the sequence now in flight that are visual tokens (None: every row), kept current through the
    # compression cut, and the mean of the kept visual embeddings: what a lookahead predictor pools over.
    interest_rows: torch.Tensor | None = None
    visual_summary: torch.Tensor | None = None
