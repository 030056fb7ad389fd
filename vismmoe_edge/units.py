"""Byte counts: parsing what users type ("2GiB", "512KB", "40%") and printing them. No heavy imports: the
daemon's option parsing uses this before torch is loaded."""

from __future__ import annotations

import re

from vismmoe_edge.errors import VismmoeError

SIZE_UNITS = {
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
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str, total: int | None = None) -> int:
    """Bytes from "2GiB", "1.5GB", "512MiB", "123456", or with `total` a share of it such as "40%".

    `what` names the value in errors ("memory budget", "--max-image-bytes")."""
    text = text.strip()
    if text.endswith("%") and total is not None:
        try:
            share = float(text[:-1])
        except ValueError as e:
            raise VismmoeError(f"{what} {text!r}: not a percentage; use e.g. 40%") from e
        if not 0 < share <= 100:
            raise VismmoeError(f"{what} {text!r}: a percentage must be in (0, 100]")
        return int(total * share / 100)
    m = _SIZE.match(text)
    unit = m["unit"].lower() if m else None
    if m is None or unit not in SIZE_UNITS:
        share = ", or a share like 40%" if total is not None else ""
        raise VismmoeError(f"{what} {text!r}: use a size like 2GiB, 512MiB, 8GB or 1048576{share}")
    value = int(float(m["value"]) * SIZE_UNITS[unit])
    if value <= 0:
        raise VismmoeError(f"{what} {text!r} must be positive")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
