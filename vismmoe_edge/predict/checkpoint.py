"""The trained predictor's torch checkpoint (predictor.pt, written by train-predictor) and its training curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vismmoe_edge.errors import VismmoeError


def save_checkpoint(path: Path, model: Any, curves: Any) -> None:
    import torch

    meta = model.metadata() | {"width": model.net[0].out_features, "dropout": model.net[3].p}
    torch.save({"metadata": meta, "state_dict": model.state_dict(), "curves": curves.to_dict()}, path)


def load_checkpoint(path: Path) -> Any:
    """A LookaheadMLP saved by train-predictor (eval mode, CPU)."""
    import torch

    from vismmoe_edge.predict.lookahead import LookaheadMLP

    if not path.is_file():
        raise VismmoeError(f"{path}: predictor checkpoint not found (train-predictor writes predictor.pt)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        m = saved["metadata"]
        model = LookaheadMLP(
            m["num_layers"], m["num_experts"], m["hidden_dim"], m["history"], m["window"], m["form"],
            m["width"], m["dropout"], top_b=m["top_b"], gamma=m["gamma"],
        )  # fmt: skip
        model.load_state_dict(saved["state_dict"])
    except (KeyError, RuntimeError, OSError, ValueError) as e:
        raise VismmoeError(f"{path}: not a predictor checkpoint ({type(e).__name__}: {e})"[:300]) from e
    return model.eval()


def plot_curves(curves: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (loss_ax, recall_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    for form, c in curves.items():
        epochs = range(1, len(c["train_loss"]) + 1)
        loss_ax.plot(epochs, c["train_loss"], label=f"{form} train")
        if c["val_loss"]:
            loss_ax.plot(epochs, c["val_loss"], "--", label=f"{form} validation")
            recall_ax.plot(epochs, c["val_recall20"], label=form)
    loss_ax.set(xlabel="epoch", ylabel="soft BCE", title="loss")
    recall_ax.set(xlabel="epoch", ylabel="recall@20, next layer", title="validation hot recall")
    loss_ax.legend()
    recall_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
