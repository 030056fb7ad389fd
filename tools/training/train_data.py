"""Training data for tools/training/train_demo.py: whole batches of one fixed image size, pre-tokenized, made in
workers.

Every batch holds images of one bucket (a fixed width x height), so every tensor of a step has a static shape and
the step can be captured as a CUDA graph. A sample is one image followed by `slots` question/answer turns, each in
a fixed-length slot. The turns are independent: the attention mask (tools/training/train_fast.py) lets a turn see the
image and itself only, and every turn's positions start right after the image, so each turn is exactly the prompt
`vismmoe-edge eval` gives the model (one question after the image), and no answer can be read off another turn.

The workers send uint8 pixels ([B, H, W, 3], a quarter of the float bytes; patchified and normalised on the GPU),
token ids, answer targets and the per-token auxiliary labels.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from vismmoe_edge.evaluation import shapes_vqa as sv
from vismmoe_edge.prompt import build_messages

# v2: independent turns, balanced hard-negative existence, bound colour, conjunctions; v3: + wide layouts (every
# split's backgrounds, radii and placements, from the training seeds) and relation questions in all directions
DATA_VERSION = "shapes-vqa-train-v3"
TEXT_CLASSES = [str(d) for d in range(10)] + list(sv.WORDS)
# class 0 = nothing there; the 4th head marks the cell holding an object's centre (one per object: what counts)
AUX_CLASSES = (len(sv.PALETTE) + 1, len(sv.SHAPES) + 1, len(TEXT_CLASSES) + 1, 2)
IGNORE = -100
TEXT_MASKS = Path(__file__).with_name("text_masks.json")


def pin_text_masks(path: Path = TEXT_MASKS) -> str:
    """Render text with the masks recorded on the CPU machine where eval runs, if this machine's font renders
    them differently (another Pillow or FreeType): the training images must be the images eval scores. Call it
    before the data workers start (they inherit the module). Returns what was done, for training.json."""
    from PIL import Image

    stored = json.loads(path.read_text())["masks"]
    masks = {}
    for text, entry in stored.items():
        h, w = entry["shape"]
        bits = np.unpackbits(np.frombuffer(bytes.fromhex(entry["bits"]), dtype=np.uint8))[: h * w]
        masks[text] = bits.reshape(h, w).astype(bool)
    if all(np.array_equal(np.asarray(sv._text_mask(t)) > 0, m) for t, m in masks.items()):
        return "local font renders the recorded masks"
    images = {t: Image.fromarray((m * 255).astype(np.uint8), "L") for t, m in masks.items()}
    sv._text_mask = lambda text: images[text]  # noqa: E731 - a module-level override, on purpose
    return "recorded masks used (the local font renders text differently)"


# ---------------------------------------------------------------------------------------------------------------
# Buckets


@dataclass(frozen=True)
class Bucket:
    width: int
    height: int
    batch: int  # images per step
    slots: int  # question/answer turns per image
    slot_len: int  # tokens per turn slot
    prefix_len: int  # tokens before the first image token ("<|im_start|>user\n<|vision_start|>")

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of 16-px patches."""
        return self.height // 16, self.width // 16

    @property
    def visual_tokens(self) -> int:
        return (self.height // 32) * (self.width // 32)

    @property
    def ctx_len(self) -> int:
        """Prefix, image tokens and <|vision_end|>: what every turn sees."""
        return self.prefix_len + self.visual_tokens + 1

    @property
    def seq_len(self) -> int:
        return self.ctx_len + self.slots * self.slot_len

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}"


def make_buckets(
    sides: tuple[int, ...], token_budget: int, slots: int, slot_len: int, prefix_len: int, multiple: int = 8
) -> list[Bucket]:
    """Every (width, height) from `sides`, each with as many images as fit `token_budget` LLM tokens per step."""
    buckets = []
    for w in sides:
        for h in sides:
            seq = prefix_len + (w // 32) * (h // 32) + 1 + slots * slot_len
            batch = max(multiple, token_budget // seq // multiple * multiple)
            buckets.append(Bucket(w, h, batch, slots, slot_len, prefix_len))
    return buckets


# ---------------------------------------------------------------------------------------------------------------
# Token layout


class TurnEncoder:
    """Token ids of the eval prompt's parts, from the checkpoint's own processor and chat template.

    The eval prompt of one question is ctx + turn(question), ctx = "<|im_start|>user\\n<|vision_start|>" + image
    tokens + "<|vision_end|>", turn = question + "<|im_end|>\\n<|im_start|>assistant\\n"; the model then answers
    with the answer's tokens and <|im_end|>. Special tokens split the text into separately tokenized pieces, so
    a turn tokenizes the same alone as inside the whole prompt (tests/test_train_demo.py checks it)."""

    def __init__(self, processor: Any) -> None:
        self.tokenizer = processor.tokenizer
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.vision_end = tok.convert_tokens_to_ids("<|vision_end|>")
        text = processor.apply_chat_template(build_messages("Q", 1), tokenize=False, add_generation_prompt=True)
        head, tail = text.split("<|image_pad|>")
        self.prefix = tok(head, add_special_tokens=False)["input_ids"]
        self.generation_suffix = tail[tail.index("Q") + 1 :]  # "<|im_end|>\n<|im_start|>assistant\n"
        self._cache: dict[tuple[str, str], tuple[list[int], int]] = {}

    def prompt_ids(self, question: str) -> list[int]:
        """The turn's prompt part: what follows <|vision_end|> in the eval prompt."""
        return self.tokenizer(question + self.generation_suffix, add_special_tokens=False)["input_ids"]

    def turn(self, question: str, answer: str) -> tuple[list[int], int]:
        """(ids of prompt + answer + <|im_end|>, length of the prompt part)."""
        key = (question, answer)
        if key not in self._cache:
            prompt = self.prompt_ids(question)
            answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            self._cache[key] = (prompt + answer_ids + [self.im_end], len(prompt))
        return self._cache[key]

    def ctx_ids(self, visual_tokens: int) -> list[int]:
        return self.prefix + [self.image_id] * visual_tokens + [self.vision_end]


def encode_sample(
    encoder: TurnEncoder, bucket: Bucket, qas: list[sv.QA]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [seq_len], targets [slots * slot_len] (the next token where it is an answer token or the closing
    <|im_end|>, IGNORE elsewhere; indexed like the slot region of ids) and the real-token mask [seq_len]."""
    ids = torch.full((bucket.seq_len,), encoder.pad_id, dtype=torch.long)
    real = torch.zeros(bucket.seq_len, dtype=torch.bool)
    targets = torch.full((bucket.slots * bucket.slot_len,), IGNORE, dtype=torch.long)
    ctx = encoder.ctx_ids(bucket.visual_tokens)
    ids[: len(ctx)] = torch.tensor(ctx)
    real[: len(ctx)] = True
    slot = 0
    for qa in qas:
        if slot == bucket.slots:
            break
        turn, prompt_len = encoder.turn(qa.question, qa.answer)
        if len(turn) > bucket.slot_len:
            continue  # a turn that does not fit its slot is skipped, never cut
        start = slot * bucket.slot_len
        ids[bucket.ctx_len + start : bucket.ctx_len + start + len(turn)] = torch.tensor(turn)
        real[bucket.ctx_len + start : bucket.ctx_len + start + len(turn)] = True
        # logits at position t predict token t+1: the answer's first token is predicted at the prompt's last token
        for t in range(prompt_len - 1, len(turn) - 1):
            targets[start + t] = turn[t + 1]
        slot += 1
    return ids, targets, real


# ---------------------------------------------------------------------------------------------------------------
# Scenes, questions and auxiliary labels


def pick_turns(by_family: dict[str, list[sv.QA]], rng: random.Random, limit: int) -> list[sv.QA]:
    """Up to `limit` questions, families taken in turn (shuffled order) so each gets an equal share while it has
    questions left: evaluation weighs the six families equally."""
    pools = {f: rng.sample(qas, len(qas)) for f, qas in by_family.items() if qas}
    families = list(pools)
    rng.shuffle(families)
    picked: list[sv.QA] = []
    while len(picked) < limit and any(pools.values()):
        for family in families:
            if pools[family] and len(picked) < limit:
                picked.append(pools[family].pop())
    return picked


def _cell_share(mask: np.ndarray, grid: tuple[int, int, int, int]) -> np.ndarray:
    """Share of True pixels in each cell of a crop shaped (rows, cell, cols, cell)."""
    return mask.reshape(grid).mean(axis=(1, 3))


def token_labels(scene: sv.Scene, image: np.ndarray, mode: str = "object") -> np.ndarray:
    """[tokens, 4] labels of each 32x32-pixel visual token (raster order, as the vision tower emits merged tokens):
    colour, shape, text (class 0 = none) and whether the object's centre is in the cell.

    A cell belongs to an object where at least a fifth of its pixels are the object's exact colour (its body) or
    it holds ink of the object's label (its text). mode "cell" (attempts 5-6): body cells get colour and shape,
    text cells the text. mode "object": body and text cells alike get all three of the object's attributes, so
    the token of a label knows whose label it is and the token of a body knows what is written below it; reading
    and colour questions become "find the token that matches the words, read its other attribute"."""
    rows, cols = scene.height // sv.TOKEN_PX, scene.width // sv.TOKEN_PX
    labels = np.zeros((rows, cols, 4), dtype=np.int64)
    colors, shapes, cell = list(sv.PALETTE), list(sv.SHAPES), sv.TOKEN_PX
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.box()
        r0, r1 = max(0, y0 // cell), min(rows, y1 // cell + 1)
        c0, c1 = max(0, x0 // cell), min(cols, x1 // cell + 1)
        crop = image[r0 * cell : r1 * cell, c0 * cell : c1 * cell]
        ys = np.arange(r0 * cell, r1 * cell).reshape(-1, 1)
        grid = (r1 - r0, cell, c1 - c0, cell)
        body = _cell_share((crop == sv.PALETTE[obj.color]).all(-1), grid) >= 0.2
        ink = np.zeros_like(body)
        if obj.text is not None:
            ink = _cell_share((crop == sv.TEXT_RGB).all(-1) & (ys > obj.y + obj.radius), grid) >= 0.03
        text_class = TEXT_CLASSES.index(obj.text) + 1 if obj.text is not None else 0
        view = labels[r0:r1, c0:c1]
        owned = (body | ink) if mode == "object" else body
        view[..., 0][owned] = colors.index(obj.color) + 1
        view[..., 1][owned] = shapes.index(obj.shape) + 1
        if mode == "object":
            view[..., 2][owned] = text_class
        elif obj.text is not None:
            view[..., 2][ink] = text_class
        cy, cx = min(rows - 1, obj.y // cell), min(cols - 1, obj.x // cell)
        labels[cy, cx, 3] = 1
    return labels.reshape(-1, 4)


@dataclass
class StreamConfig:
    seed: int
    buckets: list[Bucket]
    confusable: float = 0.5  # share of scenes drawn from few colours and shapes
    aux_labels: str = "object"
    background_reuse: float = 4.0  # mean uses of a rendered background (1: every scene its own)
    text_boost: float = 0.5  # chance that an object without a label gets one: reading has the fewest questions
    wide_layout: float = 0.5  # share of scenes drawn with sv.WIDE_LAYOUT (any split's backgrounds, radii, edges)


class BackgroundCache:
    """Rendered backgrounds per image size, each reused about `reuse` times: a background is most of a worker's
    time (a noise background of 1056 x 1056 px takes ~40 ms, the objects ~2 ms) and carries no answer. A scene
    draws a fresh background with probability 1 / reuse (which then replaces a random cached one), else a
    random cached one, so backgrounds keep turning over."""

    def __init__(self, reuse: float, size: int = 16, render: Any = sv._background) -> None:
        self.reuse, self.size, self.render = reuse, size, render  # render: swapped out by the leak check
        self.cache: dict[tuple[int, int], list[Any]] = {}

    def get(self, scene: sv.Scene, rng: random.Random) -> Any | None:
        if self.reuse <= 1:
            return None
        pool = self.cache.setdefault((scene.width, scene.height), [])
        if len(pool) < self.size or rng.random() < 1 / self.reuse:
            image = self.render(scene)
            if len(pool) < self.size:
                pool.append(image)
            else:
                pool[rng.randrange(self.size)] = image
            return image
        return pool[rng.randrange(len(pool))]


class BatchStream(IterableDataset):
    """An endless stream of whole batches from the train seed; each worker draws its own substream (its own
    buckets, scenes and questions), so the stream is fixed by (seed, number of workers)."""

    def __init__(self, config: StreamConfig, processor: Any) -> None:
        self.config = config
        self.encoder = TurnEncoder(processor)
        self.backgrounds = BackgroundCache(config.background_reuse)

    def draw(self, rng: random.Random, bucket: Bucket) -> tuple[sv.Scene, list[sv.QA], Any | None]:
        """One training sample before rendering: its scene, question turns and (reused) background."""
        size = (bucket.width, bucket.height)
        layout = sv.WIDE_LAYOUT if rng.random() < self.config.wide_layout else None
        if rng.random() < self.config.confusable:
            scene = sv.confusable_scene(rng, size=size, layout=layout)
        else:
            scene = sv.make_scene(rng, size=size, layout=layout)
        for obj in scene.objects:  # the label area is reserved below every object, so any may get one
            if obj.text is None and rng.random() < self.config.text_boost:
                obj.text = rng.choice(TEXT_CLASSES)
        turns = pick_turns(sv.training_qas(scene, rng), rng, bucket.slots)
        return scene, turns, self.backgrounds.get(scene, rng)

    def worker_rng(self, worker: int) -> random.Random:
        train_seed = sv.SPLITS["train"][0]
        return random.Random(f"{train_seed}:batches:{self.config.seed}:{worker}")

    def batch(self, rng: random.Random, bucket: Bucket) -> dict[str, torch.Tensor]:
        images = np.empty((bucket.batch, bucket.height, bucket.width, 3), dtype=np.uint8)
        ids = torch.empty((bucket.batch, bucket.seq_len), dtype=torch.long)
        real = torch.empty((bucket.batch, bucket.seq_len), dtype=torch.bool)
        targets = torch.empty((bucket.batch, bucket.slots * bucket.slot_len), dtype=torch.long)
        labels = np.empty((bucket.batch, bucket.visual_tokens, 4), dtype=np.int64)
        for i in range(bucket.batch):
            scene, turns, background = self.draw(rng, bucket)
            images[i] = np.asarray(sv.render(scene, background))
            ids[i], targets[i], real[i] = encode_sample(self.encoder, bucket, turns)
            labels[i] = token_labels(scene, images[i], self.config.aux_labels)
        return {
            "images": torch.from_numpy(images),
            "ids": ids,
            "real": real,
            "targets": targets,
            "token_labels": torch.from_numpy(labels),
        }

    def __iter__(self):
        info = get_worker_info()
        rng = self.worker_rng(info.id if info is not None else 0)
        while True:
            index = rng.randrange(len(self.config.buckets))
            batch = self.batch(rng, self.config.buckets[index])
            batch["bucket"] = torch.tensor(index)
            yield batch


def main(argv: list[str] | None = None) -> None:
    """Images per second one data worker makes, per bucket (what the loader's worker count has to cover)."""
    import argparse
    import time

    from vismmoe_edge.demo import TRAINED_DEMO_DIR
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--sides", default="448,1056")
    parser.add_argument("--images", type=int, default=48, help="images per bucket (after a warm-up batch)")
    parser.add_argument("--background-reuse", type=float, default=4.0)
    args = parser.parse_args(argv)
    processor = load_processor(TRAINED_DEMO_DIR)
    prefix = len(TurnEncoder(processor).prefix)
    sides = [int(s) for s in args.sides.split(",")]
    for w, h in [(w, h) for w in sides for h in sides]:
        bucket = Bucket(w, h, args.images, 16, 24, prefix)
        stream = BatchStream(StreamConfig(0, [bucket], background_reuse=args.background_reuse), processor)
        rng = random.Random(0)
        stream.batch(rng, Bucket(w, h, 40, 16, 24, prefix))  # fills the background cache, as a running worker has
        start = time.perf_counter()
        stream.batch(rng, bucket)
        rate = args.images / (time.perf_counter() - start)
        print(f"{bucket.name:>9s}: {rate:6.1f} images/s per worker ({1000 / rate:5.1f} ms an image)")


if __name__ == "__main__":
    main()  # PYTHONPATH=. python tools/training/train_data.py
