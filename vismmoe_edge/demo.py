"""The built-in demo model (the trained Shapes-VQA checkpoint shipped in the package) and its sample image.

The demo model is a small Qwen3-VL-MoE trained on Shapes-VQA (`tools/training/train_demo.py`), shipped inside the
package (`vismmoe_edge/demo_model/`, docs/demo-model.md). Tiny random checkpoints for tests live in
`vismmoe_edge.testing`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from vismmoe_edge.errors import VismmoeError

if TYPE_CHECKING:
    from vismmoe_edge.evaluation.shapes_vqa import Example

TRAINED_DEMO_DIR = Path(__file__).resolve().parent / "demo_model"
SAMPLE_IMAGE_NAME = "sample-v2.png"
# The sample image is Shapes-VQA test scene 7 (three triangles and one orange circle); the README asks the demo
# model this question about it.
SAMPLE_EXAMPLE = ("test", 7)
SAMPLE_QUESTION = "What colour is the circle?"
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


def sample_example() -> Example:
    """The Shapes-VQA example behind the sample image (its scene, question and answer)."""
    from vismmoe_edge.evaluation import shapes_vqa as sv

    split, index = SAMPLE_EXAMPLE
    return sv.generate_example(split, index, sv.SPLITS[split][0], shifted=split in sv.SHIFTED_SPLITS)


def ensure_sample_image() -> Path:
    """The sample image (Shapes-VQA test scene 7, rendered by the generator) in the cache dir, made once."""
    final = demo_cache_dir() / SAMPLE_IMAGE_NAME
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".png", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            from vismmoe_edge.evaluation import shapes_vqa as sv

            sv.render(sample_example().scene).save(f, format="PNG")
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
