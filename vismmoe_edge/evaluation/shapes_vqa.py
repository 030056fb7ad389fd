"""Shapes-VQA: a procedural visual question-answering data set, generated deterministically from a seed.

    python -m vismmoe_edge.evaluation.shapes_vqa OUT_DIR --split test --n 200

Each image holds 2-6 flat-coloured shapes (circle, square, triangle), some with a digit or a 3-letter word printed
below them, on a mostly redundant background (flat, gradient, tiled, noise, clutter lines). Image sides are
multiples of 32 in [448, 1056], so a 32-px-per-token vision encoder sees 196-1,089 visual tokens. Questions come in
six families modelled on MME/POPE/OCRBench (color, shape, count, position, existence, reading) and have short,
lowercase, exact answers. Only unambiguous questions are generated. The `shifted` split uses background kinds,
object sizes and placements (near the edges) that the other splits never use, to test generalisation.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
# Saturated colours: every one has a channel <= 60 or is pure white/black, so no background pixel (channels kept
# in [120, 240]) ever equals one exactly; tests rely on that to find objects by exact colour.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
    "purple": (140, 50, 180),
    "orange": (245, 130, 20),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
TEXT_RGB = (60, 60, 70)  # not a palette colour, so labels never merge with a black object's pixels
WORDS = ("cat", "dog", "sun", "map", "key", "owl", "cup", "fox", "hat", "pen", "box", "car")
FAMILIES = ("color", "shape", "count", "position", "existence", "reading")

BACKGROUNDS = ("flat", "gradient", "tiled", "noise", "clutter")
SHIFTED_BACKGROUNDS = ("stripes", "radial")
SIDES = tuple(range(448, 1056 + 1, 32))
TOKEN_PX = 32
# Radius ranges per size; the shifted split uses smaller smalls and larger larges.
RADII = {"small": (24, 34), "large": (50, 70)}
SHIFTED_RADII = {"small": (16, 22), "large": (74, 90)}
TEXT_SCALE = 3  # the default font is ~8 px tall; x3 gives ~24 px text
LABEL_H = 34  # room reserved below an object for its text (the tallest label is 30 px, pasted 2 px below)
LABEL_HALF_W = 34  # the widest label ("map") is 66 px, so a small object's box is widened to hold it
GAP = 12  # minimum gap between object boxes, so objects never touch (tests count connected components)


def _half_width(radius: int) -> int:
    return max(radius, LABEL_HALF_W)


@dataclass
class SceneObject:
    shape: str
    color: str
    size: str
    x: int
    y: int
    radius: int
    text: str | None = None

    def box(self) -> tuple[int, int, int, int]:
        """Bounding box of the shape plus its label area (x0, y0, x1, y1)."""
        half = _half_width(self.radius)
        return (self.x - half, self.y - self.radius, self.x + half, self.y + self.radius + LABEL_H)


@dataclass
class Scene:
    width: int
    height: int
    background: str
    background_rgb: tuple[int, int, int]
    background_seed: int
    objects: list[SceneObject] = field(default_factory=list)


@dataclass
class QA:
    question: str
    answer: str
    family: str


@dataclass
class Example:
    id: str
    scene: Scene
    question: str
    answer: str
    family: str


# ---------------------------------------------------------------------------------------------------------------
# Scene sampling


def _sample_background(
    rng: random.Random, shifted: bool, kinds: tuple[str, ...] | None = None
) -> tuple[str, tuple[int, int, int]]:
    kind = rng.choice(kinds if kinds is not None else SHIFTED_BACKGROUNDS if shifted else BACKGROUNDS)
    # Muted pastel: channels in [150, 220], far from every palette colour.
    rgb = (rng.randint(150, 220), rng.randint(150, 220), rng.randint(150, 220))
    return kind, rgb


def _sample_position(rng: random.Random, width: int, height: int, radius: int, shifted: bool) -> tuple[int, int]:
    lo_x, hi_x = _half_width(radius) + 4, width - _half_width(radius) - 4
    lo_y, hi_y = radius + 4, height - radius - LABEL_H - 4
    if not shifted:
        # Keep training objects away from the border.
        lo_x, hi_x, lo_y, hi_y = lo_x + 32, hi_x - 32, lo_y + 32, hi_y - 32
        return rng.randint(lo_x, hi_x), rng.randint(lo_y, hi_y)
    # Shifted: hug one of the edges.
    band = max(8, min(width, height) // 8)
    x, y = rng.randint(lo_x, hi_x), rng.randint(lo_y, hi_y)
    edge = rng.choice(("left", "right", "top", "bottom"))
    if edge == "left":
        x = rng.randint(lo_x, lo_x + band)
    elif edge == "right":
        x = rng.randint(hi_x - band, hi_x)
    elif edge == "top":
        y = rng.randint(lo_y, lo_y + band)
    else:
        y = rng.randint(hi_y - band, hi_y)
    return x, y


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return not (a[2] + GAP < b[0] or b[2] + GAP < a[0] or a[3] + GAP < b[1] or b[3] + GAP < a[1])


@dataclass(frozen=True)
class Layout:
    """Training only: which backgrounds, radii and placements a scene draws from. The splits never pass one; a
    training scene with `WIDE_LAYOUT` looks like either split (any of their backgrounds, radii spanning both, and
    objects hugging an edge with probability `edge_share`), drawn from the training stream's own seeds."""

    backgrounds: tuple[str, ...]
    radii: dict[str, tuple[int, int]]
    edge_share: float


WIDE_LAYOUT = Layout(
    backgrounds=BACKGROUNDS + SHIFTED_BACKGROUNDS,
    radii={
        "small": (SHIFTED_RADII["small"][0], RADII["small"][1]),
        "large": (RADII["large"][0], SHIFTED_RADII["large"][1]),
    },
    edge_share=0.5,
)


def _sample_text(rng: random.Random) -> str | None:
    roll = rng.random()
    if roll < 0.3:
        return str(rng.randint(0, 9))
    if roll < 0.55:
        return rng.choice(WORDS)
    return None


def make_scene(
    rng: random.Random,
    *,
    shifted: bool = False,
    sides: tuple[int, ...] = SIDES,
    size: tuple[int, int] | None = None,
    colors: tuple[str, ...] | None = None,
    shapes: tuple[str, ...] | None = None,
    objects_range: tuple[int, int] = (2, 6),
    layout: Layout | None = None,
) -> Scene:
    """`sides` narrows the image sizes (a training curriculum); the splits always use SIDES. Training only:
    `size` fixes (width, height) (static shapes), `colors`/`shapes` narrow what objects may be (confusable
    scenes), `objects_range` how many are attempted and `layout` mixes the splits' backgrounds, radii and
    placements. With the defaults the draws are those the splits were made with."""
    width, height = size if size is not None else (rng.choice(sides), rng.choice(sides))
    kind, rgb = _sample_background(rng, shifted, layout.backgrounds if layout is not None else None)
    radii = layout.radii if layout is not None else SHIFTED_RADII if shifted else RADII
    objects: list[SceneObject] = []
    target = rng.randint(*objects_range)
    colors = colors if colors is not None else tuple(PALETTE)
    shapes = shapes if shapes is not None else SHAPES
    for _ in range(200):  # rejection sampling; a crowded small image may end with fewer objects
        if len(objects) == target:
            break
        size_name = rng.choice(SIZES)
        radius = rng.randint(*radii[size_name])
        edge = shifted if layout is None else rng.random() < layout.edge_share
        x, y = _sample_position(rng, width, height, radius, edge)
        obj = SceneObject(rng.choice(shapes), rng.choice(colors), size_name, x, y, radius, _sample_text(rng))
        if not any(_overlaps(obj.box(), other.box()) for other in objects):
            objects.append(obj)
    return Scene(width, height, kind, rgb, rng.randrange(2**31), objects)


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def _clip(arr: np.ndarray) -> np.ndarray:
    # [120, 240] keeps every background pixel off the palette (see PALETTE).
    return np.clip(arr, 120, 240).astype(np.uint8)


def _background(scene: Scene) -> Image.Image:
    """The background image. Built from per-row and per-column terms instead of full coordinate grids, and the
    two-colour patterns (tiled, stripes) from a boolean pattern: the same float32/float64 arithmetic per pixel as
    the full-grid formulas, so the pixels are bit-identical to them (tests/test_shapes_vqa.py holds image
    digests), at a third of the time; training workers render millions of these."""
    w, h, base = scene.width, scene.height, np.array(scene.background_rgb, dtype=np.float32)
    nrng = np.random.default_rng(scene.background_seed)
    xs = np.arange(w, dtype=np.float32)  # mgrid's xx row (exact: small integers)
    ys = np.arange(h, dtype=np.float32)[:, None]  # mgrid's yy column
    kind = scene.background
    if kind in ("flat", "clutter"):
        arr = np.broadcast_to(_clip(base), (h, w, 3)).copy()
    elif kind == "gradient":
        other = base + nrng.uniform(-30, 30, 3)
        t = (xs / w * 0.5 + ys / h * 0.5)[..., None]
        arr = _clip(base * (1 - t) + other * t)
    elif kind == "tiled":
        tile = int(nrng.choice([16, 24, 32]))
        checker = ((np.arange(w) // tile)[None, :] + (np.arange(h) // tile)[:, None]) & 1
        arr = np.stack([_clip(base + np.float32(0.0)), _clip(base + np.float32(12.0))])[checker]
    elif kind == "noise":
        arr = _clip(base + nrng.normal(0, 6, (h, w, 3)))
    elif kind == "stripes":
        period = int(nrng.choice([20, 28, 40]))
        stripe = ((np.arange(w)[None, :] + np.arange(h)[:, None]) // period) & 1
        arr = np.stack([_clip(base - np.float32(0.0)), _clip(base - np.float32(25.0))])[stripe]
    elif kind == "radial":
        r = np.sqrt((xs - w / 2) ** 2 + (ys - h / 2) ** 2) / (0.5 * np.hypot(w, h))
        arr = _clip(base * (1 - 0.3 * r[..., None]) + 20.0)
    else:
        raise ValueError(f"unknown background kind {kind!r}")
    image = Image.fromarray(arr, "RGB")
    if kind == "clutter":
        draw = ImageDraw.Draw(image)
        for _ in range(int(nrng.integers(3, 8))):
            pts = [(int(nrng.integers(0, w)), int(nrng.integers(0, h))) for _ in range(2)]
            grey = int(nrng.integers(125, 200))
            draw.line(pts, fill=(grey, grey, grey), width=int(nrng.integers(1, 4)))
    return image


def _draw_shape(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x, y, r, fill = obj.x, obj.y, obj.radius, PALETTE[obj.color]
    if obj.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif obj.shape == "square":
        s = int(r * 0.85)
        draw.rectangle((x - s, y - s, x + s, y + s), fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(x, y - r), (x - r, y + int(r * 0.8)), (x + r, y + int(r * 0.8))], fill=fill)
    else:
        raise ValueError(f"unknown shape {obj.shape!r}")


@functools.lru_cache(maxsize=64)
def _text_mask(text: str) -> Image.Image:
    """Binary, upscaled text: crisp pixels (no antialiasing) so it stays readable and deterministic. Cached:
    callers only read it (as a paste mask)."""
    font = ImageFont.load_default()
    x0, y0, x1, y1 = font.getbbox(text)
    small = Image.new("L", (x1 - x0 + 2, y1 - y0 + 2), 0)
    ImageDraw.Draw(small).text((1 - x0, 1 - y0), text, fill=255, font=font)
    small = small.point(lambda v: 255 if v > 100 else 0)
    return small.resize((small.width * TEXT_SCALE, small.height * TEXT_SCALE), Image.Resampling.NEAREST)


def render(scene: Scene, background: Image.Image | None = None) -> Image.Image:
    """The scene's image. Training only: `background` (an image of the scene's size) replaces the scene's own
    background, so a worker can reuse backgrounds, the costly part; the splits never pass one."""
    image = _background(scene) if background is None else background.copy()
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        _draw_shape(draw, obj)
        if obj.text:
            mask = _text_mask(obj.text)
            # Centred below the shape, inside the reserved label area.
            image.paste(TEXT_RGB, (obj.x - mask.width // 2, obj.y + obj.radius + 2), mask)
    return image


# ---------------------------------------------------------------------------------------------------------------
# Questions


def _plural(shape: str) -> str:
    return shape + "s"


def _describe(obj: SceneObject, objects: list[SceneObject]) -> str | None:
    """The shortest unambiguous noun phrase for obj, or None if no phrase picks it out alone."""
    for keys in (("shape",), ("color", "shape"), ("size", "color", "shape")):
        matches = [o for o in objects if all(getattr(o, k) == getattr(obj, k) for k in keys)]
        if len(matches) == 1:
            return " ".join(getattr(obj, k) for k in keys)
    return None


def _color_qas(scene: Scene) -> list[QA]:
    qas = []
    for shape in SHAPES:
        matches = [o for o in scene.objects if o.shape == shape]
        if len(matches) == 1:
            qas.append(QA(f"What colour is the {shape}?", matches[0].color, "color"))
    return qas


def _shape_qas(scene: Scene) -> list[QA]:
    qas = []
    for color in PALETTE:
        matches = [o for o in scene.objects if o.color == color]
        if len(matches) == 1:
            qas.append(QA(f"What shape is the {color} object?", matches[0].shape, "shape"))
    return qas


def _count_qas(scene: Scene) -> list[QA]:
    qas = [
        QA(f"How many {_plural(s)} are there?", str(sum(o.shape == s for o in scene.objects)), "count") for s in SHAPES
    ]
    for color in sorted({o.color for o in scene.objects}):
        qas.append(
            QA(f"How many {color} objects are there?", str(sum(o.color == color for o in scene.objects)), "count")
        )
    return qas


MIN_OFFSET = 40  # px; closer pairs would make "left of"/"higher" a judgement call


def _position_qas(scene: Scene) -> list[QA]:
    qas = []
    objs = scene.objects
    for i, a in enumerate(objs):
        for b in objs[i + 1 :]:
            da, db = _describe(a, objs), _describe(b, objs)
            if da is None or db is None:
                continue
            if abs(a.x - b.x) >= MIN_OFFSET:
                qas.append(QA(f"Is the {da} left of the {db}?", "yes" if a.x < b.x else "no", "position"))
            distinct = "shape" if a.shape != b.shape else "color" if a.color != b.color else None
            if abs(a.y - b.y) >= MIN_OFFSET and distinct:
                higher = a if a.y < b.y else b
                qas.append(QA(f"Which is higher, the {da} or the {db}?", getattr(higher, distinct), "position"))
    return qas


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _existence_qas(scene: Scene, rng: random.Random) -> list[QA]:
    present = sorted({(o.color, o.shape) for o in scene.objects})
    absent = [(c, s) for c in PALETTE for s in SHAPES if (c, s) not in present]
    # Half the time probe for an object that is not there (POPE-style hallucination check).
    if rng.random() < 0.5 or not present:
        color, shape = rng.choice(absent)
        return [QA(f"Is there {_article(color)} {color} {shape} in the image?", "no", "existence")]
    color, shape = rng.choice(present)
    return [QA(f"Is there {_article(color)} {color} {shape} in the image?", "yes", "existence")]


def _reading_qas(scene: Scene) -> list[QA]:
    qas = []
    for obj in scene.objects:
        desc = _describe(obj, scene.objects)
        if obj.text is None or desc is None:
            continue
        kind = "number" if obj.text.isdigit() else "word"
        qas.append(QA(f"What {kind} is written on the {desc}?", obj.text, "reading"))
    return qas


def questions_for(scene: Scene, rng: random.Random) -> list[QA]:
    return (
        _color_qas(scene)
        + _shape_qas(scene)
        + _count_qas(scene)
        + _position_qas(scene)
        + _existence_qas(scene, rng)
        + _reading_qas(scene)
    )


def make_example(rng: random.Random, *, shifted: bool = False) -> tuple[Scene, list[QA]]:
    scene = make_scene(rng, shifted=shifted)
    return scene, questions_for(scene, rng)


# ---------------------------------------------------------------------------------------------------------------
# Training data only (the splits never call these): scenes whose objects share colours and shapes, and question
# forms whose words do not predict the answer. Each QA carries the family of the test questions it trains.


def confusable_scene(
    rng: random.Random, *, size: tuple[int, int], shifted: bool = False, layout: Layout | None = None
) -> Scene:
    """3-6 objects drawn from two or three colours and two or three shapes: every colour and shape recurs, so
    existence questions have hard negatives and counts have distractors of the same colour or shape."""
    colors = tuple(rng.sample(list(PALETTE), rng.randint(2, 3)))
    shapes = tuple(rng.sample(SHAPES, rng.randint(2, 3)))
    return make_scene(
        rng, shifted=shifted, size=size, colors=colors, shapes=shapes, objects_range=(3, 6), layout=layout
    )


def existence_training_qas(scene: Scene, rng: random.Random, pairs: int = 3) -> list[QA]:
    """Up to `pairs` "yes" and as many "no" questions (exactly balanced). The "no"s are hard negatives first:
    a colour present in the scene with a shape present in the scene, but never on the same object, so neither
    word alone says "no"; then random absent pairs."""
    present = sorted({(o.color, o.shape) for o in scene.objects})
    colors, shapes = sorted({c for c, _ in present}), sorted({s for _, s in present})
    hard = [(c, s) for c in colors for s in shapes if (c, s) not in present]
    easy = [(c, s) for c in PALETTE for s in SHAPES if (c, s) not in present and (c, s) not in hard]
    yes = rng.sample(present, min(pairs, len(present)))
    rng.shuffle(hard)
    rng.shuffle(easy)
    n_hard = min(len(hard), max(1, (2 * len(yes) + 2) // 3)) if yes else 0  # about two thirds hard
    no = hard[:n_hard] + easy[: len(yes) - n_hard]

    def ask(color: str, shape: str, answer: str) -> QA:
        return QA(f"Is there {_article(color)} {color} {shape} in the image?", answer, "existence")

    return [ask(c, s, "yes") for c, s in yes] + [ask(c, s, "no") for c, s in no]


def _extreme(objs: list[SceneObject], key: str, lowest: bool) -> SceneObject | None:
    """The object with the smallest (or largest) x or y, if it beats the runner-up by MIN_OFFSET."""
    ranked = sorted(objs, key=lambda o: getattr(o, key), reverse=not lowest)
    if len(ranked) < 2 or abs(getattr(ranked[0], key) - getattr(ranked[1], key)) < MIN_OFFSET:
        return None
    return ranked[0]


def bound_color_qas(scene: Scene) -> list[QA]:
    """Colour questions that name the object by shape and size or by shape and position ("the leftmost
    circle"): the colour must be read off the object the words pick out, not off any object of that shape."""
    qas = []
    for shape in SHAPES:
        same = [o for o in scene.objects if o.shape == shape]
        if len(same) < 2:
            continue  # a lone shape is asked the test's own way ("What colour is the circle?")
        for size in SIZES:
            sized = [o for o in same if o.size == size]
            if len(sized) == 1:
                qas.append(QA(f"What colour is the {size} {shape}?", sized[0].color, "color"))
        for word, key, lowest in (("leftmost", "x", True), ("rightmost", "x", False), ("highest", "y", True)):
            obj = _extreme(same, key, lowest)
            if obj is not None:
                qas.append(QA(f"What colour is the {word} {shape}?", obj.color, "color"))
    return qas


def conjunction_count_qas(scene: Scene) -> list[QA]:
    """Conjunction counts ("How many red circles are there?") for each present colour and each shape: objects of
    that colour but another shape, and of that shape but another colour, are distractors (answers include 0)."""
    colors = sorted({o.color for o in scene.objects})
    return [
        QA(
            f"How many {color} {_plural(shape)} are there?",
            str(sum(o.color == color and o.shape == shape for o in scene.objects)),
            "count",
        )
        for color in colors
        for shape in SHAPES
    ]


def relation_qas(scene: Scene) -> list[QA]:
    """Position relations in the other directions ("right of", "above", "below", "Which is lower"): the test asks
    only "left of" and "higher", and a model that learns those two as answer priors of the words gets the shifted
    split's layouts wrong. Same unambiguous phrases and MIN_OFFSET as the test's forms."""
    qas = []
    objs = scene.objects
    for i, a in enumerate(objs):
        for b in objs[i + 1 :]:
            da, db = _describe(a, objs), _describe(b, objs)
            if da is None or db is None:
                continue
            if abs(a.x - b.x) >= MIN_OFFSET:
                qas.append(QA(f"Is the {da} right of the {db}?", "yes" if a.x > b.x else "no", "position"))
            if abs(a.y - b.y) >= MIN_OFFSET:
                qas.append(QA(f"Is the {da} above the {db}?", "yes" if a.y < b.y else "no", "position"))
                qas.append(QA(f"Is the {db} below the {da}?", "yes" if b.y > a.y else "no", "position"))
                distinct = "shape" if a.shape != b.shape else "color" if a.color != b.color else None
                if distinct:
                    lower = a if a.y > b.y else b
                    qas.append(QA(f"Which is lower, the {da} or the {db}?", getattr(lower, distinct), "position"))
    return qas


def training_qas(scene: Scene, rng: random.Random) -> dict[str, list[QA]]:
    """Every training question about a scene, by family: the test's forms (existence replaced by the balanced
    hard-negative set), plus the bound colour, conjunction count and relation forms. Questions are unique within a
    family."""
    qas = (
        _color_qas(scene)
        + bound_color_qas(scene)
        + _shape_qas(scene)
        + _count_qas(scene)
        + conjunction_count_qas(scene)
        + _position_qas(scene)
        + relation_qas(scene)
        + existence_training_qas(scene, rng)
        + _reading_qas(scene)
    )
    by_family: dict[str, list[QA]] = {f: [] for f in FAMILIES}
    seen: set[str] = set()
    for qa in qas:
        if qa.question not in seen:
            seen.add(qa.question)
            by_family[qa.family].append(qa)
    return by_family


# ---------------------------------------------------------------------------------------------------------------
# Splits

# name -> (seed, size). Seeds differ, and every example draws from its own rng seeded by "seed:index", so no two
# splits share a scene stream.
SPLITS: dict[str, tuple[int, int]] = {
    "train": (1_000, 5_000),
    "validation": (2_000, 500),
    "test": (3_000, 500),
    "shifted": (4_000, 500),
}
SHIFTED_SPLITS = frozenset({"shifted"})


def generate_example(name: str, index: int, seed: int, *, shifted: bool = False) -> Example:
    """Example `index` of a split; families rotate so every family is equally represented."""
    rng = random.Random(f"{seed}:{index}")  # str seeds hash with sha512: stable across runs and platforms
    family = FAMILIES[index % len(FAMILIES)]
    while True:  # existence/count questions always exist, the others almost always within a few scenes
        scene, qas = make_example(rng, shifted=shifted)
        candidates = [qa for qa in qas if qa.family == family]
        if candidates:
            qa = rng.choice(candidates)
            return Example(f"{name}-{index:05d}", scene, qa.question, qa.answer, qa.family)


def generate_split(name: str, n: int, seed: int, *, shifted: bool = False) -> list[Example]:
    return [generate_example(name, i, seed, shifted=shifted) for i in range(n)]


def write_split(out_dir: str | Path, name: str, n: int, seed: int, shifted: bool = False) -> Path:
    """PNGs under OUT_DIR/NAME/images and OUT_DIR/NAME/questions.jsonl; returns the jsonl path."""
    split_dir = Path(out_dir) / name
    (split_dir / "images").mkdir(parents=True, exist_ok=True)
    jsonl = split_dir / "questions.jsonl"
    with jsonl.open("w") as f:
        for ex in generate_split(name, n, seed, shifted=shifted):
            rel = f"images/{ex.id}.png"
            render(ex.scene).save(split_dir / rel)
            record = {"image": rel, "question": ex.question, "answer": ex.answer, "family": ex.family}
            f.write(json.dumps(record) + "\n")
    return jsonl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--split", choices=sorted(SPLITS), default="test")
    parser.add_argument("--n", type=int, default=None, help="number of examples (default: the split's size)")
    args = parser.parse_args(argv)
    seed, size = SPLITS[args.split]
    jsonl = write_split(args.out_dir, args.split, args.n or size, seed, args.split in SHIFTED_SPLITS)
    print(jsonl)


if __name__ == "__main__":
    main()
