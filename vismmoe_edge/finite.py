"""NaN/Inf logits stop a request with the first decoder layer whose output was not finite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError


def check_finite(
    language_model: Any, logits: torch.Tensor, step: str, replay: Callable[..., object], *args: Any
) -> None:
    """Stop on NaN/Inf logits, naming the first decoder layer whose output was not finite. The normal path
    costs one reduction over the vocabulary (the sampler syncs on the logits anyway); only a failed step is
    run again, with a check after each layer."""
    if bool(torch.isfinite(logits).all()):
        return
    found: list[int] = []

    def probe(index: int) -> Callable[..., None]:
        def check(module: object, args: object, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not found and not bool(torch.isfinite(out).all()):
                found.append(index)

        return check

    handles = [layer.register_forward_hook(probe(i)) for i, layer in enumerate(language_model.layers)]
    try:
        replay(*args)
    finally:
        for handle in handles:
            handle.remove()
    where = f"decoder layer {found[0]}" if found else "the final norm or lm_head"
    raise VismmoeError(
        f"non-finite logits at {step}: the first non-finite output is {where}'s; the weights or inputs hold "
        "NaN or Inf (check the checkpoint, or try --dtype float32)"
    )
