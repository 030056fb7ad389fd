"""The demo's sample image: Shapes-VQA test scene 7 (three triangles and one orange circle), rendered by the
generator into the cache directory once; the README asks the demo model SAMPLE_QUESTION about it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vismmoe_edge.demo import demo_cache_dir, umask
from vismmoe_edge.evaluation import shapes_vqa as sv

SAMPLE_IMAGE_NAME = "sample-v2.png"
SAMPLE_EXAMPLE = ("test", 7)
SAMPLE_QUESTION = "What colour is the circle?"


def sample_example() -> sv.Example:
    """The Shapes-VQA example behind the sample image (its scene, question and answer)."""
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
            sv.render(sample_example().scene).save(f, format="PNG")
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
