"""Reading a model directory's config.json with one-line errors, shared by the family dispatch and each family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vismmoe_edge.errors import VismmoeError


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not directory.is_dir():
        raise VismmoeError(f"{directory}: no such model directory")
    if not path.exists():
        raise VismmoeError(f"{directory}: no config.json; point --model at a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VismmoeError(f"{path}: not valid JSON ({e}); re-download it") from e
    if not isinstance(raw, dict):
        raise VismmoeError(f"{path}: not a JSON object; re-download it")
    return raw
