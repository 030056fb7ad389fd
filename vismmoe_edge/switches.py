"""Switches of "auto", on ("1" or True) and off ("0" or False), as the VISMMOE_* variables and engine fields take,
and the variables that take a count."""

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


def count_setting(variable: str, value: str | None, default: int, zero: str) -> int:
    """A VISMMOE_* count: unset or empty for `default`, else a whole number >= 0; anything else is a one-line error
    naming `variable` and saying what 0 does (`zero`)."""
    if value is None or value == "":
        return default
    if not value.isdigit():
        raise VismmoeError(f"{variable}={value!r}: use a whole number >= 0 ({zero})")
    return int(value)
