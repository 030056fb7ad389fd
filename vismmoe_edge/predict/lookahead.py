"""The learned lookahead expert predictor (VisMMOE): a small MLP that, at MoE layer i, scores the experts of the
next W MoE layers from the recent routing history, the pooled hidden state, the visual summary and the layer.

Inputs (concatenated): history [B, H*E], hidden [B, D], visual [B, D], layer_onehot [B, L]; D may be 0.
Output: logits [B, E] (form "window": one score per expert over the whole window) or [B, W, E] ("per_layer").
The hidden/visual normalisation is part of the model (buffers), so an export needs no side data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vismmoe_edge.predict.calibration import CalibrationSet, split_by_request
from vismmoe_edge.predict.metrics import hot_recall
from vismmoe_edge.predict.targets import FORMS, Form, decayed_targets

HISTORY = 3
WINDOW = 5


class LookaheadMLP(nn.Module):
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        hidden_dim: int,
        history: int = HISTORY,
        window: int = WINDOW,
        form: Form = "window",
        width: int = 256,
        dropout: float = 0.1,
        *,
        top_b: int = 20,
        gamma: float = 0.8,
    ) -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"form {form!r}: use one of {', '.join(FORMS)}")
        self.num_layers, self.num_experts, self.hidden_dim = num_layers, num_experts, hidden_dim
        self.history, self.window, self.form = history, window, form
        self.top_b, self.gamma = top_b, gamma  # how the targets were made: the runtime reads them from metadata
        # identity until fit_normalisation: zeros/ones keep an untrained model well defined
        self.register_buffer("hidden_mean", torch.zeros(hidden_dim))
        self.register_buffer("hidden_std", torch.ones(hidden_dim))
        self.register_buffer("visual_mean", torch.zeros(hidden_dim))
        self.register_buffer("visual_std", torch.ones(hidden_dim))
        inputs = history * num_experts + 2 * hidden_dim + num_layers
        outputs = num_experts * (window if form == "per_layer" else 1)
        self.net = nn.Sequential(
            nn.Linear(inputs, width),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(width, width),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(width, outputs),
        )

    def metadata(self) -> dict[str, Any]:
        """What a runtime must know to build inputs and read outputs (stored in the ONNX metadata_props)."""
        return {
            "form": self.form,
            "window": self.window,
            "top_b": self.top_b,
            "gamma": self.gamma,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "history": self.history,
            "hidden_dim": self.hidden_dim,
        }

    @torch.no_grad()
    def fit_normalisation(self, hidden: np.ndarray, visual: np.ndarray) -> None:
        """Mean/std of hidden and visual from the training set; constant features get std 1, not a division by 0."""
        for name, values in (("hidden", hidden), ("visual", visual)):
            if values.shape[1] == 0 or values.shape[0] == 0:
                continue
            x = torch.from_numpy(np.asarray(values, dtype=np.float32))
            std = x.std(dim=0, unbiased=False)
            getattr(self, f"{name}_mean").copy_(x.mean(dim=0))
            getattr(self, f"{name}_std").copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(
        self, history: torch.Tensor, hidden: torch.Tensor, visual: torch.Tensor, layer_onehot: torch.Tensor
    ) -> torch.Tensor:
        hidden = (hidden - self.hidden_mean) / self.hidden_std
        visual = (visual - self.visual_mean) / self.visual_std
        logits = self.net(torch.cat([history, hidden, visual, layer_onehot], dim=1))
        if self.form == "per_layer":
            return logits.unflatten(1, (self.window, self.num_experts))
        return logits


def layer_onehot(layer: np.ndarray, num_layers: int) -> np.ndarray:
    """float32 [N, L] one-hot of MoE layer positions."""
    out = np.zeros((len(layer), num_layers), dtype=np.float32)
    out[np.arange(len(layer)), layer] = 1.0
    return out


def model_inputs(data: CalibrationSet) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(history [N, H*E], hidden, visual, layer_onehot) as float32 tensors, in forward's order."""
    history = data.history.reshape(len(data), data.history.shape[1] * data.history.shape[2])
    arrays = (history, data.hidden, data.visual, layer_onehot(data.layer, data.num_layers))
    return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays)


def soft_bce(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Binary cross-entropy with logits against soft targets; per_layer rows of invalid w are left out."""
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    if valid is None or logits.dim() == 2:
        return loss.mean()
    weight = valid.unsqueeze(-1).expand_as(loss).float()
    return (loss * weight).sum() / weight.sum().clamp(min=1)


@torch.no_grad()
def eval_logits(model: LookaheadMLP, inputs: Sequence[torch.Tensor], batch_size: int = 4096) -> torch.Tensor:
    """Logits of the model in eval mode (BatchNorm running stats, no dropout), in batches."""
    was_training = model.training
    model.eval()
    n = inputs[0].shape[0]
    parts = [model(*(x[s : s + batch_size] for x in inputs)) for s in range(0, n, batch_size)]
    model.train(was_training)
    if not parts:
        shape = (0, model.window, model.num_experts) if model.form == "per_layer" else (0, model.num_experts)
        return torch.zeros(shape)
    return torch.cat(parts)


def predict_scores(model: LookaheadMLP, data: CalibrationSet, batch_size: int = 4096) -> np.ndarray:
    """Sigmoid scores [N, E] or [N, W, E] of a trained model."""
    return torch.sigmoid(eval_logits(model, model_inputs(data), batch_size)).numpy()


@dataclass
class TrainCurves:
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_recall20: list[float] = field(default_factory=list)
    train_samples: int = 0
    val_samples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _with_future(data: CalibrationSet) -> CalibrationSet:
    """Samples at the last MoE layer have nothing ahead to predict: they would only teach 'all zeros'."""
    return data.subset(data.future_valid.any(axis=1))


def train_predictor(
    data: CalibrationSet,
    *,
    form: Form = "window",
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 256,
    val_requests: float | Sequence[int] | np.ndarray = 0.2,
    seed: int = 0,
    top_b: int = 20,
    gamma: float = 0.8,
    width: int = 256,
    dropout: float = 0.1,
    weight_decay: float = 1e-2,
    progress: bool = True,
) -> tuple[LookaheadMLP, TrainCurves]:
    """Train a LookaheadMLP with soft BCE and AdamW on a request-level split of data; deterministic from seed.

    val_requests: share of requests held out at random, or the explicit request ids (0 or [] = no validation).
    Returns the model (eval mode, CPU) and per-epoch train loss, validation loss and validation recall@20
    (of the next layer's hot set).
    """
    from tqdm import tqdm

    train, val = split_by_request(_with_future(data), val_requests, seed)
    if len(train) < 2:
        raise ValueError(f"{len(train)} training samples with a future layer: need at least 2")
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG stays untouched
        torch.manual_seed(seed)
        model = LookaheadMLP(
            data.num_layers, data.num_experts, data.hidden_dim, data.history_len, data.window, form,
            width, dropout, top_b=top_b, gamma=gamma,
        )  # fmt: skip
        model.fit_normalisation(train.hidden, train.visual)
        inputs = model_inputs(train)
        target = torch.from_numpy(decayed_targets(train.future, train.future_valid, top_b, gamma, form))
        valid = torch.from_numpy(train.future_valid)
        val_inputs = model_inputs(val)
        val_target = torch.from_numpy(decayed_targets(val.future, val.future_valid, top_b, gamma, form))
        val_valid = torch.from_numpy(val.future_valid)
        optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        order = torch.Generator().manual_seed(seed)
        curves = TrainCurves(train_samples=len(train), val_samples=len(val))
        bar = tqdm(range(epochs), desc=f"train predictor ({form})", unit="epoch", disable=not progress)
        for _ in bar:
            model.train()
            total, seen = 0.0, 0
            for batch in torch.randperm(len(train), generator=order).split(batch_size):
                if len(batch) < 2:  # BatchNorm needs two rows to estimate a variance
                    continue
                loss = soft_bce(model(*(x[batch] for x in inputs)), target[batch], valid[batch])
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
                total, seen = total + loss.item() * len(batch), seen + len(batch)
            curves.train_loss.append(total / max(seen, 1))
            if len(val):
                logits = eval_logits(model, val_inputs)
                curves.val_loss.append(float(soft_bce(logits, val_target, val_valid)))
                recall = hot_recall(torch.sigmoid(logits).numpy(), val.future, val.future_valid, ks=(20,), top_b=top_b)
                curves.val_recall20.append(recall["recall@20"])
                bar.set_postfix(train=f"{curves.train_loss[-1]:.4f}", val=f"{curves.val_loss[-1]:.4f}",
                                recall20=f"{curves.val_recall20[-1]:.3f}")  # fmt: skip
            else:
                bar.set_postfix(train=f"{curves.train_loss[-1]:.4f}")
    model.eval()
    return model, curves
