"""Shared fixtures: tiny real Qwen3-VL-MoE checkpoints (built once per session) and sample images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests must not touch the user's cache: the demo model and sample image go to a temporary XDG cache.
os.environ.setdefault("VISMMOE_EDGE_CACHE", str(Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / "vismmoe-test-cache"))
# Two pytest-xdist workers share the two cores: one thread each, rather than four threads fighting for two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
if os.environ.get("VISMMOE_TEST_NO_CUDNN_SDPA") == "1":  # racecheck: cuDNN's flash SDPA reports hazards of its own
    torch.backends.cuda.enable_cudnn_sdp(False)

# 10 MoE layers so that a 25% budget still leaves room for streamed experts beside a 2-layer pinned prefix.
TEST_LAYERS = 10


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same random weights written in each expert layout (fp32, several shards)."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {
        layout: build_tiny_checkpoint(root / layout, seed=7, layout=layout, num_layers=TEST_LAYERS)
        for layout in ("v5", "hub", "per_expert")
    }


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two different images of different sizes (different visual grids)."""
    from PIL import Image, ImageDraw

    root = tmp_path_factory.mktemp("img")
    paths = []
    for i, (w, h) in enumerate([(224, 160), (128, 192)]):
        img = Image.new("RGB", (w, h), (30 + 100 * i, 120, 200 - 80 * i))
        draw = ImageDraw.Draw(img)
        draw.ellipse((10, 10, 10 + w // 3, 10 + h // 3), fill=(220, 30, 30))
        draw.rectangle((w // 2, h // 2, w - 8, h - 8), fill=(20, 20, 220))
        path = root / f"img{i}.png"
        img.save(path)
        paths.append(path)
    return paths

@pytest.fixture(scope="session")
def references(checkpoints: dict[str, Path], images: list[Path]) -> dict:
    """transformers' own greedy tokens and logits on the v5 checkpoint, once per session (tests/hf_reference.py).
    Modules that test another checkpoint define their own `references`, which takes precedence."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from tests.hf_reference import hf_references
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor
    from vismmoe_edge.prompt import encode_prompt, load_image

    model_dir = checkpoints["v5"]
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, experts_implementation="eager").eval()
    processor = load_qwen3_vl_processor(model_dir)
    return hf_references(model, lambda prompt, paths: encode_prompt(processor, prompt, [load_image(p) for p in paths]),
                         images)  # fmt: skip



@pytest.fixture()
def cold_checkpoints(checkpoints, tmp_path: Path) -> dict[str, Path]:
    """Private copies of the checkpoints, none of whose pages is in the page cache.

    The shared checkpoints do not do for page-cache assertions: an engine an earlier test left for the garbage
    collector may still map them, and pages mapped elsewhere survive every drop (in CI a "cold" miss read 0 bytes
    from disk: its pages had never left)."""
    import shutil

    from vismmoe_edge.experts import pagecache

    copies = {layout: Path(shutil.copytree(path, tmp_path / layout)) for layout, path in checkpoints.items()}
    for path in copies.values():
        for shard in path.glob("*.safetensors"):
            assert pagecache.evict_file(shard, attempts=50) == 0, f"{shard} stays in the page cache"
    return copies


@pytest.fixture()
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile whose compiled functions raise when called, as a compiler without its C toolchain does."""

    def failing_compile(fn, **kwargs):  # type: ignore[no-untyped-def]
        def fail(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("no C compiler")

        return fail

    monkeypatch.setattr(torch, "compile", failing_compile)
