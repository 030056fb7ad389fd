"""How large is Shapes-VQA's text where the model looks at it? Measures and draws what the demo model is given.

    PYTHONPATH=. python tools/training/text_legibility.py [OUT.png] [--split test] [--n 4]

Prints the ink size of every label (digits and words) in pixels and in 32x32-pixel visual tokens, checks that the
demo model's processor passes the split's images at their own size (the pixels it patchifies, un-patchified, are
the rendered image), and writes crops of reading questions' labels from those pixels, 4x enlarged, with the
32-pixel token grid drawn in magenta.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from vismmoe_edge.demo import TRAINED_DEMO_DIR
from vismmoe_edge.evaluation import shapes_vqa as sv
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor


def model_pixels(processor, image: Image.Image) -> np.ndarray:
    """The image as the model receives it: the processor's patches put back in place, de-normalised."""
    enc = processor.image_processor(images=[image], return_tensors="np")
    _, gh, gw = (int(v) for v in enc["image_grid_thw"][0])
    p, m = 16, 2
    x = enc["pixel_values"].reshape(gh // m, gw // m, m, m, 3, 2, p, p)[..., 0, :, :]  # first temporal copy
    x = x.transpose(0, 2, 5, 1, 3, 6, 4).reshape(gh * p, gw * p, 3)
    return np.clip(np.round((x * 0.5 + 0.5) * 255), 0, 255).astype(np.uint8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=Path("text-crops.png"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args(argv)
    for text in [str(d) for d in range(10)] + list(sv.WORDS):
        ys, xs = np.nonzero(np.asarray(sv._text_mask(text)))
        h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
        print(f"{text:>3s}: ink {h} x {w} px = {h / 32:.2f} x {w / 32:.2f} tokens")
    processor = load_processor(TRAINED_DEMO_DIR)
    seed, _ = sv.SPLITS[args.split]
    examples = [e for e in sv.generate_split(args.split, 60, seed) if e.family == "reading"][: args.n]
    crops = []
    for ex in examples:
        image = sv.render(ex.scene)
        seen = model_pixels(processor, image)
        same = seen.shape[:2] == (ex.scene.height, ex.scene.width) and np.array_equal(seen, np.asarray(image))
        print(f"{ex.id} {ex.scene.width}x{ex.scene.height}: the model gets the image unchanged: {same}; {ex.question}")
        obj = next(o for o in ex.scene.objects if o.text == ex.answer)
        y0, x0 = obj.y + obj.radius - 16, obj.x - 48
        crop = seen[max(0, y0) : y0 + 64, max(0, x0) : x0 + 96]
        big = np.repeat(np.repeat(crop, 4, axis=0), 4, axis=1)
        for gx in range(0, seen.shape[1], 32):
            if x0 <= gx < x0 + 96:
                big[:, (gx - x0) * 4] = (255, 0, 255)
        for gy in range(0, seen.shape[0], 32):
            if y0 <= gy < y0 + 64:
                big[(gy - y0) * 4, :] = (255, 0, 255)
        crops.append(big)
    sheet = np.full((max(c.shape[0] for c in crops), sum(c.shape[1] + 10 for c in crops), 3), 255, dtype=np.uint8)
    x = 0
    for c in crops:
        sheet[: c.shape[0], x : x + c.shape[1]] = c
        x += c.shape[1] + 10
    Image.fromarray(sheet).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
