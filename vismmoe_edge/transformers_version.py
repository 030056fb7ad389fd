"""The transformers versions this package is written against (pyproject.toml's `transformers>=5.20,<6`), checked
when a model is loaded: an older one would fail much later, deep inside a layer (5.x renamed the masks' cache
argument), and a GPU machine's preinstalled copy is easy to pick up by accident."""

from __future__ import annotations

import re

from vismmoe_edge.errors import VismmoeError

SUPPORTED = ((5, 20), (6, 0))  # [lowest, first unsupported)
REQUIREMENT = f"transformers>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}"


def check_transformers(version: str | None = None) -> None:
    if version is None:
        import transformers

        version = transformers.__version__
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if not SUPPORTED[0] <= numbers < SUPPORTED[1]:
        raise VismmoeError(
            f"transformers {version} is installed; vismmoe-edge needs {REQUIREMENT}: pip install '{REQUIREMENT}'"
        )
