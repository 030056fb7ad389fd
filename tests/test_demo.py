"""Offline processor, tiny checkpoints in three layouts, and the cached demo model/image."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import Qwen3VLMoeForConditionalGeneration

from vismmoe_edge import demo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.evaluation import sample
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor
from vismmoe_edge.testing import tiny_qwen3_vl_moe as tiny
from vismmoe_edge.testing.tiny_qwen3_vl_moe import SPECIAL_TOKENS, build_offline_processor

E, H, INTER = 16, 128, 48  # tiny_config defaults
MAX_SHARD = 200_000  # "200KB" in transformers' units
EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _index(d: Path) -> dict[str, str]:
    return json.loads((d / demo.INDEX_NAME).read_text())["weight_map"]


def _read(d: Path, key: str) -> torch.Tensor:
    with safe_open(str(d / _index(d)[key]), framework="pt") as f:
        return f.get_tensor(key)


def _chat(image: Image.Image, text: str = "Describe the image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {layout: tiny.build_tiny_checkpoint(root / layout, seed=0, layout=layout) for layout in tiny.LAYOUTS}


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        build_offline_processor(min_pixels=4096, max_pixels=65536).save_pretrained(tmp_path / name)
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()
    tok = build_offline_processor(min_pixels=4096, max_pixels=65536).tokenizer
    text = "Ünïcode 🙂 <|im_start|>user\n7 squares<|image_pad|>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: exact round trip
    for special in SPECIAL_TOKENS:  # never split into pieces
        assert tok(special)["input_ids"] == [tok.convert_tokens_to_ids(special)]


@pytest.mark.parametrize("layout", tiny.LAYOUTS)
def test_checkpoint_shards_and_index(ckpts: dict[str, Path], layout: str) -> None:
    d = ckpts[layout]
    weight_map = _index(d)
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1
    assert sorted(p.name for p in d.glob("*.safetensors")) == shards
    seen: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(d / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            seen.update(dict.fromkeys(f.keys(), shard))
        if layout != "per_expert":  # a shard over the limit holds one oversized tensor only
            raw = (d / shard).read_bytes()
            header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
            header.pop("__metadata__")
            assert len(header) == 1 or len(raw) <= MAX_SHARD + 8192
    assert seen == weight_map

    layer = "model.language_model.layers.0.mlp.experts"
    if layout == "per_expert":
        assert not any(k.endswith(EXPERT_SUFFIXES) for k in weight_map)
        assert sum(k.startswith(f"{layer}.") for k in weight_map) == 3 * E
        assert _read(d, f"{layer}.3.gate_proj.weight").shape == (INTER, H)
        assert _read(d, f"{layer}.3.down_proj.weight").shape == (H, INTER)
    else:
        fused = {"v5": ((E, 2 * INTER, H), (E, H, INTER)), "hub": ((E, H, 2 * INTER), (E, INTER, H))}[layout]
        assert tuple(_read(d, f"{layer}.gate_up_proj").shape) == fused[0]
        assert tuple(_read(d, f"{layer}.down_proj").shape) == fused[1]


def test_hub_layout_loads_to_v5_weights(ckpts: dict[str, Path]) -> None:
    v5 = Qwen3VLMoeForConditionalGeneration.from_pretrained(ckpts["v5"]).state_dict()
    hub = Qwen3VLMoeForConditionalGeneration.from_pretrained(ckpts["hub"]).state_dict()
    assert v5.keys() == hub.keys()
    assert all(torch.equal(v5[k], hub[k]) for k in v5)
    assert sum(k.endswith(EXPERT_SUFFIXES) for k in v5) == 2 * 6


def test_per_expert_equals_slices_of_fused(ckpts: dict[str, Path]) -> None:
    v5, pe = ckpts["v5"], ckpts["per_expert"]
    fused = [k for k in _index(v5) if k.endswith(".mlp.experts.gate_up_proj")]
    assert len(fused) == 6
    for key in fused:
        prefix = key.rsplit(".", 1)[0]
        gate_up, down = _read(v5, key), _read(v5, f"{prefix}.down_proj")
        for j in range(E):
            assert torch.equal(_read(pe, f"{prefix}.{j}.gate_proj.weight"), gate_up[j, :INTER])
            assert torch.equal(_read(pe, f"{prefix}.{j}.up_proj.weight"), gate_up[j, INTER:])
            assert torch.equal(_read(pe, f"{prefix}.{j}.down_proj.weight"), down[j])
    # Everything that is not an expert is untouched.
    rest = [k for k in _index(v5) if not k.endswith(EXPERT_SUFFIXES)]
    assert all(torch.equal(_read(v5, k), _read(pe, k)) for k in rest[:20])


def test_processor_round_trip_and_image_tokens(ckpts: dict[str, Path]) -> None:
    proc = load_processor(ckpts["v5"])
    image = Image.new("RGB", (224, 160), (235, 230, 215))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = proc.apply_chat_template(
        msgs,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"images": [image]},
    )
    for key in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert key in out
    grid = out["image_grid_thw"][0]
    n_pad = int((out["input_ids"] == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert n_pad == int(grid.prod()) // 4 == 35  # 224x160 -> 10x14 patches -> 35 merged tokens
    assert int(out["mm_token_type_ids"].sum()) == n_pad
    assert tuple(out["pixel_values"].shape) == (int(grid.prod()), 3 * 2 * 16 * 16)


def test_load_processor_hub_style_dir(ckpts: dict[str, Path], tmp_path: Path) -> None:
    # What a Hugging Face Qwen3-VL repo ships: fast-class names, chat_template.json, a video config.
    (tmp_path / "tokenizer.json").write_bytes((ckpts["v5"] / "tokenizer.json").read_bytes())
    chat_template = (ckpts["v5"] / "chat_template.jinja").read_text()
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "bos_token": None,
        },
        "preprocessor_config.json": {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
            "processor_class": "Qwen3VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessorFast",
        },
        "video_preprocessor_config.json": {
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "processor_class": "Qwen3VLProcessor",
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
        "chat_template.json": {"chat_template": chat_template},
    }
    for name, body in files.items():
        (tmp_path / name).write_text(json.dumps(body))
    proc = load_processor(tmp_path)
    assert proc.image_processor.size.shortest_edge == 65536
    out = proc.apply_chat_template(
        _chat(Image.new("RGB", (64, 64))), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert out["image_grid_thw"][0][0] == 1
    video = proc.video_processor  # transformers' Qwen3-VL video processor, from video_preprocessor_config.json
    assert (video.patch_size, video.temporal_patch_size, video.max_video_tokens) == (16, 2, 128)

    (tmp_path / "chat_template.json").unlink()
    with pytest.raises(VismmoeError, match="chat template"):
        load_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(VismmoeError, match="preprocessor_config.json") as err:
        load_processor(tmp_path)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(VismmoeError, match="does not exist"):
        load_processor(tmp_path / "nope")


def test_demo_cache_dir_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VISMMOE_EDGE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.demo_cache_dir() == tmp_path / "xdg" / "vismmoe-edge"
    monkeypatch.setenv("VISMMOE_EDGE_CACHE", str(tmp_path / "override"))
    assert demo.demo_cache_dir() == tmp_path / "override"


def test_ensure_random_demo_model_is_idempotent(demo_cache: Path, monkeypatch) -> None:
    monkeypatch.setenv("VISMMOE_EDGE_CACHE", str(demo_cache))
    first = tiny.ensure_random_demo_model()
    assert first == demo_cache / tiny.DEMO_MODEL_NAME
    assert json.loads((first / tiny.DEMO_MARKER).read_text())["random_weights"] is True
    assert json.loads((first / "config.json").read_text())["dtype"] == "bfloat16"
    assert len(set(_index(first).values())) > 1
    stamp = (first / demo.INDEX_NAME).stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("ensure_random_demo_model rebuilt an existing model")

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", no_rebuild)
    assert tiny.ensure_random_demo_model() == first
    assert (first / demo.INDEX_NAME).stat().st_mtime_ns == stamp
    assert [p.name for p in demo_cache.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_sample_image_is_deterministic(demo_cache: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VISMMOE_EDGE_CACHE", str(demo_cache))
    path = sample.ensure_sample_image()
    assert sample.ensure_sample_image() == path
    scene = sample.sample_example().scene
    assert Image.open(path).size == (scene.width, scene.height)
    monkeypatch.setenv("VISMMOE_EDGE_CACHE", str(tmp_path))
    assert sample.ensure_sample_image().read_bytes() == path.read_bytes()


def test_shipped_demo_model_answers_the_sample_question_as_transformers_does(demo_cache: Path, monkeypatch) -> None:
    """The README's command: the trained demo model answers the sample question correctly, through our engine
    and through transformers' own model on the same checkpoint (the independent reference)."""
    monkeypatch.setenv("VISMMOE_EDGE_CACHE", str(demo_cache))
    model_dir = demo.ensure_demo_model()
    assert model_dir == demo.TRAINED_DEMO_DIR
    scene = sample.sample_example().scene
    circles = [obj for obj in scene.objects if obj.shape == "circle"]
    assert len(circles) == 1  # the question has one right answer, read off the scene itself
    answer = circles[0].color
    proc = subprocess.run(
        [sys.executable, "-m", "vismmoe_edge.cli", "run", "--prompt", sample.SAMPLE_QUESTION, "--max-new-tokens", "6"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "VISMMOE_EDGE_CACHE": str(demo_cache)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[0].strip() == answer
    assert "trained on Shapes-VQA" in proc.stderr

    processor = load_processor(model_dir)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    inputs = processor.apply_chat_template(
        _chat(Image.open(sample.ensure_sample_image()), sample.SAMPLE_QUESTION),
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    reply = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip() == answer
