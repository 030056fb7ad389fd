"""The built-in demo model (the trained Shapes-VQA checkpoint shipped in the package) and the cache directory.

The demo model is a small Qwen3-VL-MoE trained on Shapes-VQA (`tools/training/train_demo.py`), shipped inside the
package (`vismmoe_edge/demo_model/`, docs/demo-model.md); its sample image is evaluation/sample.py's. Tiny random
checkpoints for tests live in `vismmoe_edge.testing`.
"""

from __future__ import annotations

import os
from pathlib import Path

from vismmoe_edge.errors import VismmoeError

TRAINED_DEMO_DIR = Path(__file__).resolve().parent / "demo_model"
INDEX_NAME = "model.safetensors.index.json"


def demo_cache_dir() -> Path:
    """`$VISMMOE_EDGE_CACHE`, else `$XDG_CACHE_HOME/vismmoe-edge`, else `~/.cache/vismmoe-edge`."""
    override = os.environ.get("VISMMOE_EDGE_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vismmoe-edge"


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def ensure_demo_model() -> Path:
    """The built-in demo model: the trained Shapes-VQA checkpoint shipped inside the package."""
    if not (TRAINED_DEMO_DIR / INDEX_NAME).is_file():
        raise VismmoeError(f"{TRAINED_DEMO_DIR}: the built-in demo model is missing; reinstall vismmoe-edge")
    return TRAINED_DEMO_DIR
