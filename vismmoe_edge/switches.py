"""Switches of "auto", on ("1" or True) and off ("0" or False), as the VISMMOE_* variables and engine fields take."""

from __future__ import annotations

from vismmoe_edge.errors import VismmoeError


def forced(mode: bool | str, variable: str) -> bool | None:
    """What the switch forces, or None for "auto" (the caller decides); anything else is a one-line error naming
    `variable`."""
    if mode in (True, "1"):
        return True
    if mode in (False, "0"):
        return False
    if mode != "auto":
        raise VismmoeError(f"{variable}={mode!r}: use auto, 1 or 0")
    return None
