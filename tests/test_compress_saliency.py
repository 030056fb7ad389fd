"""Saliency: chunked attention-received against dense softmax, the patch order, and the vision-tower capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as qmod
from transformers.vision_utils import get_vision_position_ids

from vismmoe_edge.compress import VisionSaliency, attention_received, merge_to_llm_tokens, normalize01
from vismmoe_edge.testing.tiny_qwen3_vl_moe import (
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    build_offline_processor,
    tiny_config,
)

MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64


def dense_attention_received(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(q.double() @ k.double().transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)  # [h, N, N]
    return probs.mean(dim=(0, 1))


# -- attention_received ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 50, 130])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64, 1024])
def test_attention_received_matches_dense(n: int, chunk: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + chunk)
    q = torch.randn(3, n, 16, generator=g) * 2
    k = torch.randn(3, n, 16, generator=g) * 2
    got = attention_received(q, k, chunk=chunk)
    assert got.dtype == torch.float32 and got.shape == (n,)
    torch.testing.assert_close(got.double(), dense_attention_received(q, k), rtol=1e-5, atol=1e-7)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-5)  # each query row sums to 1


def test_attention_received_bf16_inputs_use_float32_math() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 40, 8, generator=g).bfloat16()
    k = torch.randn(2, 40, 8, generator=g).bfloat16()
    got = attention_received(q, k, chunk=9)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), dense_attention_received(q.float(), k.float()), rtol=1e-5, atol=1e-7)


class _LargestOutput(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_attention_received_never_materialises_full_matrix() -> None:
    heads, n, d, chunk = 4, 300, 8, 64
    q, k = torch.randn(heads, n, d), torch.randn(heads, n, d)
    with _LargestOutput() as probe:
        attention_received(q, k, chunk=chunk)
    assert probe.largest <= heads * chunk * n < heads * n * n


# -- patch order and merging ----------------------------------------------------------------------------


def _coordinate_image(w: int, h: int) -> Image.Image:
    """Red = patch row * 9, green = patch column * 9: each patch's position can be read back from its pixels."""
    img = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(img)
    for r in range(h // PATCH_SIZE):
        for c in range(w // PATCH_SIZE):
            box = (c * PATCH_SIZE, r * PATCH_SIZE, (c + 1) * PATCH_SIZE - 1, (r + 1) * PATCH_SIZE - 1)
            draw.rectangle(box, fill=(r * 9, c * 9, 0))
    return img


def test_patch_order_is_block_major_merge_groups() -> None:
    """Qwen2-VL/Qwen3-VL patchify: patches run (gh, gw, mh, mw); each merge*merge run is one LLM token."""
    proc = build_offline_processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    w, h = 96, 64  # multiples of 32 inside the pixel limits: no resampling, so colours survive exactly
    out = proc.image_processor(images=[_coordinate_image(w, h)], return_tensors="pt")
    grid = out["image_grid_thw"]
    assert grid.tolist() == [[1, h // PATCH_SIZE, w // PATCH_SIZE]]
    plane = TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # values per channel in a flattened patch
    pix = out["pixel_values"]
    to_byte = lambda v: torch.round((v * 0.5 + 0.5) * 255).long()  # noqa: E731 (undo mean/std 0.5)
    rows, cols = to_byte(pix[:, 0]) // 9, to_byte(pix[:, plane]) // 9

    gh, gw = h // PATCH_SIZE, w // PATCH_SIZE
    m = MERGE_SIZE
    expect = [
        (bh * m + mh, bw * m + mw)
        for bh in range(gh // m)
        for bw in range(gw // m)
        for mh in range(m)
        for mw in range(m)
    ]
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == expect
    # The vision tower's rotary positions agree with the processor's layout.
    pos = get_vision_position_ids(grid, m)
    assert pos.tolist() == [list(p) for p in expect]

    # merge_to_llm_tokens on that layout = 2x2 average pooling of the patch grid, in raster order.
    scores_2d = torch.randn(gh, gw, dtype=torch.float64)
    patch_scores = scores_2d[rows, cols]
    pooled = F.avg_pool2d(scores_2d[None, None], m).flatten()
    torch.testing.assert_close(merge_to_llm_tokens(patch_scores, (1, gh, gw), m), pooled)


def test_merge_to_llm_tokens_checks_shape() -> None:
    with pytest.raises(ValueError):
        merge_to_llm_tokens(torch.zeros(23), (1, 4, 6))
    with pytest.raises(ValueError):
        merge_to_llm_tokens(torch.zeros(15), (1, 3, 5))
    assert merge_to_llm_tokens(torch.arange(48.0), (2, 4, 6)).shape == (12,)


def test_normalize01() -> None:
    x = torch.tensor([3.0, -1.0, 1.0])
    torch.testing.assert_close(normalize01(x), torch.tensor([1.0, 0.0, 0.5]))
    assert torch.equal(normalize01(torch.full((5,), 2.5)), torch.zeros(5))
    assert normalize01(torch.zeros(0)).shape == (0,)


# -- VisionSaliency on a tiny random Qwen3-VL-MoE vision tower ----------------------------------------------


@pytest.fixture(scope="module")
def tower() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    model = Qwen3VLMoeForConditionalGeneration(tiny_config()).eval()
    proc = build_offline_processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    images = []
    for i, (w, h) in enumerate([(224, 160), (100, 190)]):
        img = Image.new("RGB", (w, h), (40 + 90 * i, 120, 200 - 70 * i))
        draw = ImageDraw.Draw(img)
        draw.ellipse((8, 8, 8 + w // 3, 8 + h // 3), fill=(220, 30, 30))
        draw.rectangle((w // 2, h // 2, w - 6, h - 6), fill=(20, 20, 220))
        images.append(img)
    out = proc.image_processor(images=images, return_tensors="pt")
    return model.model.visual, out["pixel_values"], out["image_grid_thw"]


def _hook_counts(visual: torch.nn.Module) -> tuple[int, ...]:
    mods = (visual, visual.blocks[-1].attn)
    return tuple(len(h) for m in mods for h in (m._forward_pre_hooks, m._forward_hooks))


def _reference_saliency(visual, pixel_values, grid, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Run the tower with eager attention and keep the last block's materialised softmax for each image."""
    last = visual.blocks[-1].attn
    weights: list[torch.Tensor] = []
    eager = qmod.eager_attention_forward

    def capturing(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, w = eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        if module is last:
            weights.append(w.detach())  # [1, heads, n, n], one call per image
        return out, w

    monkeypatch.setattr(qmod, "eager_attention_forward", capturing)
    monkeypatch.setattr(visual.config, "_attn_implementation_internal", "eager")
    with torch.no_grad():
        visual(pixel_values, grid_thw=grid)
    assert len(weights) == len(grid)
    merge = visual.spatial_merge_size
    return [normalize01(w[0].mean(dim=(0, 1)).reshape(-1, merge * merge).mean(dim=1)) for w in weights]


def test_vision_saliency_matches_materialised_attention(tower, monkeypatch: pytest.MonkeyPatch) -> None:
    visual, pixel_values, grid = tower
    assert grid[0].tolist() != grid[1].tolist()
    rotary = qmod.apply_rotary_pos_emb_vision
    with torch.no_grad(), VisionSaliency(visual, chunk=16, rotary=rotary) as sal:  # chunk < patches per image
        visual(pixel_values, grid_thw=grid)
    got = sal.per_image()
    want = _reference_saliency(visual, pixel_values, grid, monkeypatch)
    assert [len(s) for s in got] == [t * h * w // 4 for t, h, w in grid.tolist()]
    for g, w in zip(got, want, strict=True):
        assert g.min().item() == 0.0 and g.max().item() == 1.0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_vision_saliency_leaves_output_unchanged_and_removes_hooks(tower) -> None:
    visual, pixel_values, grid = tower
    before = _hook_counts(visual)
    with torch.no_grad():
        plain = visual(pixel_values, grid_thw=grid)
        with VisionSaliency(visual, rotary=qmod.apply_rotary_pos_emb_vision) as sal:
            assert _hook_counts(visual) != before
            captured = visual(pixel_values, grid)  # grid_thw given positionally works too
        assert _hook_counts(visual) == before
    assert torch.equal(plain.last_hidden_state, captured.last_hidden_state)
    assert torch.equal(plain.pooler_output, captured.pooler_output)
    for a, b in zip(plain.deepstack_features, captured.deepstack_features, strict=True):
        assert torch.equal(a, b)
    first = [s.clone() for s in sal.per_image()]
    with torch.no_grad():
        visual(pixel_values[: int(grid[0].prod())], grid_thw=grid[:1])  # not captured: hooks are gone
    assert all(torch.equal(a, b) for a, b in zip(first, sal.per_image(), strict=True))


def test_vision_saliency_removes_hooks_on_error(tower) -> None:
    visual, pixel_values, grid = tower
    before = _hook_counts(visual)
    with pytest.raises(RuntimeError, match="boom"), VisionSaliency(visual, rotary=qmod.apply_rotary_pos_emb_vision):
        raise RuntimeError("boom")
    assert _hook_counts(visual) == before


def test_vision_saliency_needs_a_forward(tower) -> None:
    with pytest.raises(RuntimeError, match="no vision forward"):
        VisionSaliency(tower[0], rotary=qmod.apply_rotary_pos_emb_vision).per_image()
