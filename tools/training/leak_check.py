"""Check that no scene of the evaluation splits appears in the training stream.

    PYTHONPATH=. python tools/training/leak_check.py --images 240000 --workers 15 [--seed 0]

Replays the training stream exactly as `train_demo.py` draws it (the same buckets, worker substreams, scenes,
questions and background choices; only the pixels are not rendered) and compares every training scene with every
scene of the test, shifted and validation splits. A training image is its own objects drawn over a reused
background, so it can equal a split image only if its objects do: two keys are compared, the exact object set
(shape, colour, size class, centre, radius, text) and the layout alone (shape and geometry, colours and texts
ignored). Both must find nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_data as D  # noqa: E402
from tqdm import tqdm  # noqa: E402

from vismmoe_edge.evaluation import shapes_vqa as sv  # noqa: E402

Key = tuple


def exact_key(scene: sv.Scene) -> Key:
    objects = sorted((o.shape, o.color, o.size, o.x, o.y, o.radius, o.text or "") for o in scene.objects)
    return (scene.width, scene.height, tuple(objects))


def layout_key(scene: sv.Scene) -> Key:
    return (scene.width, scene.height, tuple(sorted((o.shape, o.x, o.y, o.radius) for o in scene.objects)))


def split_keys(n: int) -> dict[str, tuple[set[Key], set[Key]]]:
    keys = {}
    for name in ("test", "shifted", "validation"):
        seed, _ = sv.SPLITS[name]
        scenes = [e.scene for e in sv.generate_split(name, n, seed, shifted=name in sv.SHIFTED_SPLITS)]
        keys[name] = ({exact_key(s) for s in scenes}, {layout_key(s) for s in scenes})
    return keys


def training_scenes(stream: D.BatchStream, workers: int, images: int):
    """Each worker's scenes in the order it makes them, until the workers together made `images`."""
    per_worker = -(-images // workers)
    for worker in range(workers):
        rng, made = stream.worker_rng(worker), 0
        while made < per_worker:
            bucket = stream.config.buckets[rng.randrange(len(stream.config.buckets))]
            for _ in range(bucket.batch):
                scene, _, _ = stream.draw(rng, bucket)
                yield scene
            made += bucket.batch


def check(
    images: int, workers: int, seed: int, sides: str, token_budget: int, split_n: int = 500, wide_layout: float = 0.5
) -> dict:
    from vismmoe_edge.demo import TRAINED_DEMO_DIR
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor

    processor = load_qwen3_vl_processor(TRAINED_DEMO_DIR)
    prefix = len(D.TurnEncoder(processor).prefix)
    buckets = D.make_buckets(tuple(int(s) for s in sides.split(",")), token_budget, 16, 24, prefix)
    stream = D.BatchStream(D.StreamConfig(seed, buckets, wide_layout=wide_layout), processor)
    stream.backgrounds = D.BackgroundCache(stream.config.background_reuse, render=lambda scene: None)
    splits = split_keys(split_n)
    hits = {name: {"exact": 0, "layout": 0} for name in splits}
    seen = 0
    for scene in tqdm(training_scenes(stream, workers, images), total=images, unit="scene", mininterval=2):
        exact, layout = exact_key(scene), layout_key(scene)
        for name, (exact_set, layout_set) in splits.items():
            hits[name]["exact"] += exact in exact_set
            hits[name]["layout"] += layout in layout_set
        seen += 1
    return {
        "training_scenes": seen,
        "split_scenes": split_n,
        "workers": workers,
        "seed": seed,
        "wide_layout": wide_layout,
        "matches": hits,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=240_000, help="training images to replay (all workers)")
    parser.add_argument("--workers", type=int, default=15, help="the run's data workers (train_demo.py --workers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="448,640,864,1056")
    parser.add_argument("--token-budget", type=int, default=160_000)
    parser.add_argument("--wide-layout", type=float, default=0.5, help="the run's --wide-layout")
    args = parser.parse_args(argv)
    result = check(args.images, args.workers, args.seed, args.sides, args.token_budget, wide_layout=args.wide_layout)
    print(result)
    if any(v for counts in result["matches"].values() for v in counts.values()):
        raise SystemExit("a split scene appears in the training stream")


if __name__ == "__main__":
    main()
