"""The transformers versions this package is written against (pyproject.toml's `transformers>=5.20,<6`), checked
when a model is loaded: an older one would fail much later, deep inside a layer (5.x renamed the masks' cache
argument), and a GPU machine's preinstalled copy is easy to pick up by accident."""

from __future__ import annotations

import re

from vismmoe_edge.errors import VismmoeError

SUPPORTED = ((5, 20), (6, 0))  # [lowest, first unsupported)


def check_transformers(version: str | None = None) -> None:
    if version is None:
        import transformers

        version = transformers.__version__
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    (lo, hi) = SUPPORTED
    if not lo <= numbers < hi:
        raise VismmoeError(
            f"transformers {version} is installed; vismmoe-edge needs >={lo[0]}.{lo[1]},<{hi[0]}: "
            f"pip install 'transformers>={lo[0]}.{lo[1]},<{hi[0]}'"
        )
