"""Is the demo model's routing learned? Per-layer expert usage of a trained model against its untrained twin.

    PYTHONPATH=. python tools/analysis/routing_learned.py --model vismmoe_edge/demo_model --split test --limit 60 \
        --json docs/results/routing-learned.json --plot docs/figures/routing-learned.png

Both models (same config, processor and images; the twin is the same config with transformers' own initialisation
from `--twin-seed`) prefill the same Shapes-VQA prompts through transformers' own model, which returns every
layer's router logits.
Over the visual tokens, per MoE layer:
- usage: the share of top-k activations per expert, its normalised entropy (1 = every expert equally used) and the
  share the top 25% of experts take;
- content: the mutual information between a token's top-1 expert and what lies under its 32x32 cell (background,
  or an object's colour and shape, from the rendered scene), normalised by the content's entropy. A router that
  learned the task sends objects and background, and objects of different kinds, to different experts; an
  untrained one routes by the input's raw statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "training"))

import train_data as D  # noqa: E402
from transformers import Qwen3VLMoeForConditionalGeneration  # noqa: E402

from vismmoe_edge.evaluation import shapes_vqa as sv  # noqa: E402
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor  # noqa: E402
from vismmoe_edge.prompt import encode_prompt  # noqa: E402


def cell_content(scene: sv.Scene, image: np.ndarray) -> np.ndarray:
    """Per visual token (row-major 32x32 cells): 0 for background, else 1 + colour * 3 + shape of the object whose
    pixels cover the cell (train_data's per-cell labels)."""
    labels = D.token_labels(scene, image, mode="cell")  # [cells, 4]: colour+1, shape+1, text+1, centre
    color, shape = labels[:, 0], labels[:, 1]
    return np.where((color > 0) & (shape > 0), 1 + (color - 1) * len(sv.SHAPES) + (shape - 1), 0)


def routed_experts(model, processor, question: str, image) -> tuple[list[np.ndarray], np.ndarray]:
    """Per MoE layer the top-k experts [visual tokens, k] of the prompt's visual tokens (the router's own top-k)."""
    inputs = encode_prompt(processor, question, [image])
    kwargs = {"input_ids": inputs.input_ids, "attention_mask": torch.ones_like(inputs.input_ids)}
    kwargs |= {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.image_grid_thw}
    if inputs.mm_token_type_ids is not None:
        kwargs["mm_token_type_ids"] = inputs.mm_token_type_ids
    with torch.no_grad():
        out = model(**kwargs, output_router_logits=True)
    model.model.rope_deltas = None
    visual = (inputs.input_ids[0] == model.config.image_token_id).numpy()
    k = model.config.text_config.num_experts_per_tok
    experts = [logits.float().topk(k, dim=-1).indices.numpy()[visual] for logits in out.router_logits]
    return experts, visual


def mutual_information(a: np.ndarray, b: np.ndarray) -> float:
    """I(a; b) / H(b) in [0, 1] from the joint counts of two label arrays."""
    joint = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(joint, (a, b), 1)
    p = joint / joint.sum()
    pa, pb = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    mi = float((p[nz] * np.log(p[nz] / (pa @ pb)[nz])).sum())
    hb = float(-(pb[pb > 0] * np.log(pb[pb > 0])).sum())
    return mi / hb if hb > 0 else 0.0


def layer_stats(topk: np.ndarray, content: np.ndarray, num_experts: int) -> dict[str, float]:
    counts = np.bincount(topk.ravel(), minlength=num_experts).astype(float)
    share = counts / counts.sum()
    entropy = -(share[share > 0] * np.log(share[share > 0])).sum() / math.log(num_experts)
    top = np.sort(share)[::-1][: num_experts // 4].sum()
    return {
        "usage_entropy": round(float(entropy), 4),
        "top25_share": round(float(top), 4),
        "content_nmi": round(mutual_information(topk[:, 0], content), 4),
        "usage": [round(float(s), 5) for s in share],
    }


def measure(model, name: str, items: list[sv.Example], processor) -> list[dict[str, float]]:
    layers: list[list[np.ndarray]] = []
    contents = []
    for ex in tqdm(items, desc=name, unit="image"):
        image = sv.render(ex.scene)
        experts, _ = routed_experts(model, processor, ex.question, image)
        if not layers:
            layers = [[] for _ in experts]
        for layer, e in enumerate(experts):
            layers[layer].append(e)
        contents.append(cell_content(ex.scene, np.asarray(image)))
    content = np.concatenate(contents)
    n = model.config.text_config.num_experts
    return [layer_stats(np.concatenate(per), content, n) for per in layers]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), gridspec_kw={"width_ratios": [2, 2, 1.4]})
    for ax, name in zip(axes[:2], ("trained", "untrained twin"), strict=True):
        usage = np.array([layer["usage"] for layer in result[name]])
        im = ax.imshow(usage, aspect="auto", cmap="viridis", vmin=0, vmax=usage.max())
        ax.set_title(f"{name}: share of activations")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        fig.colorbar(im, ax=ax)
    layers = np.arange(len(result["trained"]))
    for name, marker in (("trained", "o"), ("untrained twin", "x")):
        axes[2].plot(layers, [layer["content_nmi"] for layer in result[name]], marker=marker, label=name)
    axes[2].set_title("expert vs cell content (NMI)")
    axes[2].set_xlabel("MoE layer")
    axes[2].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--twin-seed", type=int, default=0, help="seed of the untrained twin's initialisation")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    seed, _ = sv.SPLITS[args.split]
    items = sv.generate_split(args.split, args.limit, seed, shifted=args.split in sv.SHIFTED_SPLITS)
    processor = load_qwen3_vl_processor(args.model)
    result = {"split": args.split, "images": args.limit}
    trained = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(args.model), dtype=torch.float32).eval()
    torch.manual_seed(args.twin_seed)
    twin = Qwen3VLMoeForConditionalGeneration(trained.config).eval()
    result["trained"] = measure(trained, "trained", items, processor)
    result["untrained twin"] = measure(twin, "untrained twin", items, processor)
    for name in ("trained", "untrained twin"):
        rows = result[name]
        print(
            f"{name:>15s}: usage entropy {np.mean([r['usage_entropy'] for r in rows]):.3f}, top-25% share "
            f"{np.mean([r['top25_share'] for r in rows]):.3f}, content NMI "
            + " ".join(f"{r['content_nmi']:.3f}" for r in rows)
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
