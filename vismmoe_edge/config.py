"""Run-time options that users type: memory budgets ("2GiB", "40%"), dtypes and devices."""

from __future__ import annotations

import re

import torch

from vismmoe_edge.errors import VismmoeError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_budget(text: str, total_bytes: int) -> int:
    """Bytes from "2GiB", "1.5GB", "512MiB", "123456" or a share of `total_bytes` such as "40%"."""
    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError as e:
            raise VismmoeError(f"memory budget {text!r}: not a percentage; use e.g. 40%") from e
        if not 0 < share <= 100:
            raise VismmoeError(f"memory budget {text!r}: a percentage must be in (0, 100]")
        return int(total_bytes * share / 100)
    m = _SIZE.match(text)
    unit = m["unit"].lower() if m else None
    if m is None or unit not in _UNITS:
        raise VismmoeError(f"memory budget {text!r}: use a size like 2GiB, 512MiB, 8GB, or a share like 40%")
    value = int(float(m["value"]) * _UNITS[unit])
    if value <= 0:
        raise VismmoeError(f"memory budget {text!r} must be positive")
    return value


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise VismmoeError(f"--device {name}: CUDA is not available to this torch build; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise VismmoeError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    return torch.device(name)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype, except float16 on the CPU (slow there), which becomes float32."""
    if name == "auto":
        if device.type == "cpu" and checkpoint_dtype == torch.float16:
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype.is_floating_point else torch.float32
    if name not in DTYPES:
        raise VismmoeError(f"--dtype {name!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[name]
