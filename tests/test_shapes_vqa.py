"""Shapes-VQA: deterministic splits, and answers re-derived independently (from pixels where feasible)."""

from __future__ import annotations

import io
import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vismmoe_edge.evaluation import shapes_vqa as sv

PALETTE_NAMES = list(sv.PALETTE)
PALETTE_RGB = np.array([sv.PALETTE[c] for c in PALETTE_NAMES], dtype=np.int32)
SHAPE_WORDS = {"circle", "square", "triangle"}


def png_bytes(scene: sv.Scene) -> bytes:
    buf = io.BytesIO()
    sv.render(scene).save(buf, format="PNG")
    return buf.getvalue()


# --- independent re-derivation helpers (written apart from the generator's own question code) ----------------


def resolve(phrase: str, scene: sv.Scene) -> sv.SceneObject:
    """The one object a noun phrase like 'large red circle' names; fails if it names zero or several."""
    words = phrase.split()
    found = [
        o
        for o in scene.objects
        if all(w in (o.shape, o.color, o.size) for w in words) and words[-1] == o.shape  # phrase ends in a shape
    ]
    assert len(found) == 1, f"{phrase!r} is ambiguous or absent: {found}"
    return found[0]


def nearest_palette(rgb: np.ndarray) -> str:
    d = ((PALETTE_RGB - rgb.astype(np.int32)) ** 2).sum(axis=1)
    return PALETTE_NAMES[int(np.argmin(d))]


def exact_mask(pixels: np.ndarray, color: str) -> np.ndarray:
    return np.all(pixels == np.array(sv.PALETTE[color], dtype=np.uint8), axis=-1)


def shape_from_pixels(pixels: np.ndarray, obj: sv.SceneObject) -> str:
    """Classify by how much of its bounding box the object's colour fills: square ~1, circle ~pi/4, triangle ~1/2."""
    r = obj.radius + 2
    win = exact_mask(pixels[obj.y - r : obj.y + r + 1, obj.x - r : obj.x + r + 1], obj.color)
    ys, xs = np.nonzero(win)
    fill = win.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    if fill > 0.92:
        return "square"
    if fill > 0.66:
        return "circle"
    return "triangle"


def count_components(mask: np.ndarray, stride: int = 4, min_cells: int = 4) -> int:
    """8-connected components on a strided grid; tiny fragments (a triangle's thin tip) are ignored."""
    grid = mask[::stride, ::stride]
    seen = np.zeros_like(grid, dtype=bool)
    h, w = grid.shape
    count = 0
    for sy, sx in zip(*np.nonzero(grid), strict=True):
        if seen[sy, sx]:
            continue
        stack, size = [(sy, sx)], 0
        seen[sy, sx] = True
        while stack:
            y, x = stack.pop()
            size += 1
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < h and 0 <= nx < w and grid[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
        count += size >= min_cells
    return count


def check_answer(scene: sv.Scene, pixels: np.ndarray, question: str, answer: str, family: str) -> None:
    """Re-derive the answer to one question and compare; pixels is the rendered image as an (H, W, 3) array."""
    assert re.fullmatch(r"[a-z0-9]+", answer), answer
    if family == "color":
        (shape,) = re.fullmatch(r"What colour is the (\w+)\?", question).groups()
        assert sum(o.shape == shape for o in scene.objects) == 1
        obj = resolve(shape, scene)
        assert nearest_palette(pixels[obj.y, obj.x]) == answer
    elif family == "shape":
        (color,) = re.fullmatch(r"What shape is the (\w+) object\?", question).groups()
        objs = [o for o in scene.objects if o.color == color]
        assert len(objs) == 1
        assert shape_from_pixels(pixels, objs[0]) == answer == objs[0].shape
    elif family == "count":
        m = re.fullmatch(r"How many (\w+)s are there\?", question)
        if m:
            expected = len([o for o in scene.objects if o.shape == m.group(1)])
            # Same count when each object's shape is read off the pixels instead of the scene list.
            assert sum(shape_from_pixels(pixels, o) == m.group(1) for o in scene.objects) == expected
        else:
            (color,) = re.fullmatch(r"How many (\w+) objects are there\?", question).groups()
            expected = len([o for o in scene.objects if o.color == color])
            # Flat fills never touch, so each object of that colour is one blob in the image.
            assert count_components(exact_mask(pixels, color)) == expected
        assert answer == str(expected)
    elif family == "position":
        m = re.fullmatch(r"Is the ([\w ]+) left of the ([\w ]+)\?", question)
        if m:
            a, b = resolve(m.group(1), scene), resolve(m.group(2), scene)
            assert abs(a.x - b.x) >= 20
            assert answer == ("yes" if a.x < b.x else "no")
        else:
            pa, pb = re.fullmatch(r"Which is higher, the ([\w ]+) or the ([\w ]+)\?", question).groups()
            a, b = resolve(pa, scene), resolve(pb, scene)
            assert abs(a.y - b.y) >= 20
            top, bottom = (a, b) if a.y < b.y else (b, a)
            # The answer must name the higher one and not also fit the lower one.
            assert answer in (top.shape, top.color) and answer not in (bottom.shape, bottom.color)
    elif family == "existence":
        color, shape = re.fullmatch(r"Is there an? (\w+) (\w+) in the image\?", question).groups()
        present = any(o.color == color and o.shape == shape for o in scene.objects)
        assert answer == ("yes" if present else "no")
        if present:
            assert exact_mask(pixels, color).any()
    elif family == "reading":
        kind, phrase = re.fullmatch(r"What (number|word) is written on the ([\w ]+)\?", question).groups()
        obj = resolve(phrase, scene)
        assert answer == obj.text
        assert answer.isdigit() == (kind == "number")
        # Some text-coloured pixels really are in the label area below the object.
        label = pixels[obj.y + obj.radius : obj.y + obj.radius + sv.LABEL_H, max(0, obj.x - 40) : obj.x + 40]
        assert np.all(label == np.array(sv.TEXT_RGB, dtype=np.uint8), axis=-1).sum() > 20
    else:
        raise AssertionError(f"unknown family {family}")


# --- tests ----------------------------------------------------------------------------------------------------


def test_same_seed_same_data_and_bytes() -> None:
    a = sv.generate_split("test", 24, 3_000)
    b = sv.generate_split("test", 24, 3_000)
    assert [(e.id, e.question, e.answer, e.family) for e in a] == [(e.id, e.question, e.answer, e.family) for e in b]
    assert a == b
    for ea, eb in zip(a[:4], b[:4], strict=True):
        assert png_bytes(ea.scene) == png_bytes(eb.scene)


def test_different_seeds_differ() -> None:
    splits = {name: sv.generate_split(name, 24, seed) for name, (seed, _) in sv.SPLITS.items()}
    keys = {name: [(e.scene.width, e.scene.height, e.question, e.answer) for e in ex] for name, ex in splits.items()}
    names = list(keys)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            assert keys[x] != keys[y]
    assert len({seed for seed, _ in sv.SPLITS.values()}) == len(sv.SPLITS)
    assert png_bytes(splits["train"][0].scene) != png_bytes(splits["test"][0].scene)


@pytest.mark.parametrize("name", ["train", "validation", "test", "shifted"])
def test_every_family_and_token_range(name: str) -> None:
    seed, _ = sv.SPLITS[name]
    examples = sv.generate_split(name, 200, seed, shifted=name in sv.SHIFTED_SPLITS)
    assert set(Counter(e.family for e in examples)) == set(sv.FAMILIES)
    for e in examples:
        w, h = e.scene.width, e.scene.height
        assert w % 32 == 0 and h % 32 == 0
        assert 196 <= (w // 32) * (h // 32) <= 1_089
        assert re.fullmatch(r"[a-z0-9]+", e.answer)
        assert 1 <= len(e.scene.objects) <= 6


def test_split_answers_rederived_from_pixels() -> None:
    for split in ("test", "shifted"):
        seed, _ = sv.SPLITS[split]
        for e in sv.generate_split(split, 36, seed, shifted=split in sv.SHIFTED_SPLITS):
            pixels = np.asarray(sv.render(e.scene).convert("RGB"))
            assert pixels.shape == (e.scene.height, e.scene.width, 3)
            check_answer(e.scene, pixels, e.question, e.answer, e.family)


def test_all_questions_of_sample_scenes() -> None:
    """Every question make_example offers (not only the one a split picks) is right."""
    families = Counter()
    for i in range(16):
        scene, qas = sv.make_example(random.Random(i), shifted=i % 2 == 1)
        pixels = np.asarray(sv.render(scene).convert("RGB"))
        # Each object shows as exactly one blob of its colour: nothing overlaps, nothing is off-image.
        for color in {o.color for o in scene.objects}:
            expected = sum(o.color == color for o in scene.objects)
            assert count_components(exact_mask(pixels, color)) == expected
        for qa in qas:
            check_answer(scene, pixels, qa.question, qa.answer, qa.family)
            families[qa.family] += 1
    assert set(families) == set(sv.FAMILIES)


def test_existence_probes_absent_objects() -> None:
    examples = [e for e in sv.generate_split("train", 300, sv.SPLITS["train"][0]) if e.family == "existence"]
    answers = Counter(e.answer for e in examples)
    assert answers["yes"] > 10 and answers["no"] > 10


def test_shifted_split_differs() -> None:
    train = sv.generate_split("train", 200, sv.SPLITS["train"][0])
    shifted = sv.generate_split("shifted", 200, sv.SPLITS["shifted"][0], shifted=True)
    assert {e.scene.background for e in train}.isdisjoint({e.scene.background for e in shifted})
    train_radii = {o.radius for e in train for o in e.scene.objects}
    shifted_radii = {o.radius for e in shifted for o in e.scene.objects}
    assert min(shifted_radii) < min(train_radii) and max(shifted_radii) > max(train_radii)

    def edge_share(examples: list[sv.Example]) -> float:
        """Share of objects within 32 px of an image edge (train keeps a wider margin by design)."""
        gaps = [
            min(o.x - o.radius, s.width - o.x - o.radius, o.y - o.radius, s.height - o.y - o.radius - sv.LABEL_H)
            for e in examples
            for s in [e.scene]
            for o in s.objects
        ]
        return sum(g < 32 for g in gaps) / len(gaps)

    assert edge_share(train) == 0.0
    assert edge_share(shifted) > 0.3


def test_write_split_and_cli(tmp_path: Path) -> None:
    jsonl = sv.write_split(tmp_path / "a", "test", 6, 3_000)
    again = sv.write_split(tmp_path / "b", "test", 6, 3_000)
    assert jsonl.read_bytes() == again.read_bytes()
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(records) == 6 and set(records[0]) == {"image", "question", "answer", "family"}
    for rec in records:
        assert (jsonl.parent / rec["image"]).read_bytes() == (again.parent / rec["image"]).read_bytes()
    sv.main([str(tmp_path / "cli"), "--split", "shifted", "--n", "3"])
    assert len((tmp_path / "cli" / "shifted" / "questions.jsonl").read_text().splitlines()) == 3
    assert len(list((tmp_path / "cli" / "shifted" / "images").glob("*.png"))) == 3
