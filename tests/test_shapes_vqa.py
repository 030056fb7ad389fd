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


# --- rendering is unchanged by the faster background code ----------------------------------------------------

# md5 of the rendered pixels, recorded with the full-coordinate-grid background code these splits were made with
# (before the per-row/per-column rewrite); bg-i: a scene of tests' own rng with background kind i forced.
RENDER_DIGESTS = {
    "test-00000": "db3b58364d75dd17bf111eec8f9631fc",
    "test-00001": "24aaf8ce76579a6127d71a021172b193",
    "test-00002": "91f835316390fc9c8c0282540972e054",
    "test-00003": "a321eda7633b0f5b8a3210a979cd2517",
    "shifted-00000": "4e47077d68b93303a7e1aabb8b09d735",
    "shifted-00001": "e175556860c33bdcc3d22550d877d847",
    "validation-00000": "ebfe5ce1361c81df807f656b6bd9940e",
    "bg-0": "a75f891905b7ae21b3d1b0222620aee5",
    "bg-1": "025e603ca6d1c807a4987671cc6dcc1b",
    "bg-2": "c7f05ff653b30882eaf1636499b1c14a",
    "bg-3": "f177ed6021d4f38492af24f456183543",
    "bg-4": "b89075201f2e28bb8656d0615cc265e2",
    "bg-5": "df3964443946a2f6cd437205fabe120c",
    "bg-6": "dad05e980c7cc047b6a4b3c96d909673",
}


def test_render_digests_unchanged() -> None:
    import hashlib

    def digest(scene: sv.Scene) -> str:
        return hashlib.md5(np.asarray(sv.render(scene)).tobytes()).hexdigest()

    for split in ("test", "shifted", "validation"):
        seed, _ = sv.SPLITS[split]
        for e in sv.generate_split(split, 4, seed, shifted=split in sv.SHIFTED_SPLITS):
            if e.id in RENDER_DIGESTS:
                assert digest(e.scene) == RENDER_DIGESTS[e.id], e.id
    kinds = sv.BACKGROUNDS + sv.SHIFTED_BACKGROUNDS
    rng = random.Random(5)
    for i in range(7):
        scene = sv.make_scene(rng, shifted=i % 3 == 0)
        scene.background = kinds[i]
        assert digest(scene) == RENDER_DIGESTS[f"bg-{i}"], kinds[i]


def test_render_with_a_given_background() -> None:
    scene = sv.make_scene(random.Random(3), size=(512, 448))
    assert (scene.width, scene.height) == (512, 448)
    assert np.array_equal(np.asarray(sv.render(scene, sv._background(scene))), np.asarray(sv.render(scene)))


# --- training data ---------------------------------------------------------------------------------------------


def training_scenes(n: int) -> list[sv.Scene]:
    """Plain and confusable training scenes, every other pair with the wide layout (any split's look)."""
    rng = random.Random(11)
    sizes = [(448, 448), (640, 1056), (1056, 864)]
    scenes = []
    for i in range(n):
        layout = sv.WIDE_LAYOUT if i % 4 >= 2 else None
        make = sv.confusable_scene if i % 2 else sv.make_scene
        scenes.append(make(rng, size=sizes[i % 3], layout=layout))
    return scenes


def test_wide_layout_covers_both_splits_looks() -> None:
    rng = random.Random(5)
    scenes = [sv.make_scene(rng, size=(864, 864), layout=sv.WIDE_LAYOUT) for _ in range(300)]
    kinds = {s.background for s in scenes}
    assert kinds == set(sv.BACKGROUNDS + sv.SHIFTED_BACKGROUNDS)
    radii = [o.radius for s in scenes for o in s.objects]
    assert min(radii) < sv.RADII["small"][0] and max(radii) > sv.RADII["large"][1]  # the shifted split's sizes too
    for s in scenes:  # objects stay whole inside the image, labels included
        for o in s.objects:
            x0, y0, x1, y1 = o.box()
            assert x0 >= 0 and y0 >= 0 and x1 <= s.width and y1 <= s.height


def test_existence_training_qas_balanced_hard_negatives() -> None:
    hard = easy = 0
    for scene in training_scenes(60):
        qas = sv.existence_training_qas(scene, random.Random(len(scene.objects)))
        answers = Counter(qa.answer for qa in qas)
        assert answers["yes"] == answers["no"] >= 1  # exactly balanced in every scene
        assert len({qa.question for qa in qas}) == len(qas)
        pixels = np.asarray(sv.render(scene))
        colors = {o.color for o in scene.objects}
        shapes = {o.shape for o in scene.objects}
        for qa in qas:
            color, shape = re.fullmatch(r"Is there an? (\w+) (\w+) in the image\?", qa.question).groups()
            objs = [o for o in scene.objects if o.color == color and o.shape == shape]
            assert qa.answer == ("yes" if objs else "no")
            if objs:  # the object is in the image: its colour at its centre, its shape from its pixels
                assert nearest_palette(pixels[objs[0].y, objs[0].x]) == color
                assert shape_from_pixels(pixels, objs[0]) == shape
            elif color in colors and shape in shapes:
                hard += 1  # both words are in the scene, on different objects
            else:
                easy += 1
    assert hard > easy > 0  # most negatives are hard ones; random absent pairs (as the test asks) too


def test_training_qas_answers_rederived() -> None:
    families = Counter()
    forms = Counter()
    for scene in training_scenes(40):
        pixels = np.asarray(sv.render(scene))
        by_family = sv.training_qas(scene, random.Random(1))
        assert set(by_family) == set(sv.FAMILIES)
        for family, qas in by_family.items():
            for qa in qas:
                families[family] += 1
                assert qa.family == family
                bound = r"What colour is the (small|large|leftmost|rightmost|highest) (\w+)\?"
                if m := re.fullmatch(bound, qa.question):
                    word, shape = m.groups()
                    same = [o for o in scene.objects if o.shape == shape]
                    assert len(same) >= 2  # a lone shape is asked the test's way
                    if word in sv.SIZES:
                        (obj,) = [o for o in same if o.size == word]
                    else:
                        key, sign = {"leftmost": ("x", 1), "rightmost": ("x", -1), "highest": ("y", 1)}[word]
                        obj = min(same, key=lambda o: sign * getattr(o, key))
                        others = sorted(sign * getattr(o, key) for o in same)
                        assert others[1] - others[0] >= sv.MIN_OFFSET
                    assert nearest_palette(pixels[obj.y, obj.x]) == qa.answer
                    forms["bound colour"] += 1
                elif m := re.fullmatch(r"Is the ([\w ]+) (right of|above|below) the ([\w ]+)\?", qa.question):
                    a, b = resolve(m.group(1), scene), resolve(m.group(3), scene)
                    key, sign = {"right of": ("x", -1), "above": ("y", 1), "below": ("y", -1)}[m.group(2)]
                    assert abs(getattr(a, key) - getattr(b, key)) >= sv.MIN_OFFSET
                    assert qa.answer == ("yes" if sign * getattr(a, key) < sign * getattr(b, key) else "no")
                    forms["relation"] += 1
                elif m := re.fullmatch(r"Which is lower, the ([\w ]+) or the ([\w ]+)\?", qa.question):
                    a, b = resolve(m.group(1), scene), resolve(m.group(2), scene)
                    bottom, top = (a, b) if a.y > b.y else (b, a)
                    assert qa.answer in (bottom.shape, bottom.color) and qa.answer not in (top.shape, top.color)
                    forms["relation"] += 1
                elif m := re.fullmatch(r"How many (\w+) (circle|square|triangle)s are there\?", qa.question):
                    color, shape = m.groups()
                    expected = sum(shape_from_pixels(pixels, o) == shape and o.color == color for o in scene.objects)
                    assert qa.answer == str(expected)
                    forms["conjunction count"] += 1
                else:
                    check_answer(scene, pixels, qa.question, qa.answer, qa.family)
    assert forms["bound colour"] > 20 and forms["conjunction count"] > 50 and forms["relation"] > 50
    assert set(families) == set(sv.FAMILIES)


def test_confusable_scenes_repeat_colours_and_shapes() -> None:
    rng = random.Random(2)
    for _ in range(20):
        scene = sv.confusable_scene(rng, size=(864, 864))
        assert (scene.width, scene.height) == (864, 864)
        assert 3 <= len(scene.objects) <= 6
        assert len({o.color for o in scene.objects}) <= 3 and len({o.shape for o in scene.objects}) <= 3
