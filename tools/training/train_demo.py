"""Train the shipped demo model: a small Qwen3-VL-MoE, from scratch, on the Shapes-VQA training stream.

    python tools/training/train_demo.py OUT_DIR [--steps auto|N] [--minutes 6.5] [--seed 0]

Runs on one CUDA GPU (the H200 server: ~7 minutes). Everything is drawn from `--seed`: the weights' init, the data
stream (train-seed scenes, disjoint from the validation/test/shifted seeds), dropout-free training order. With
`--steps auto` it times the first steps and picks the step count that fits `--minutes`; the chosen count is
written to OUT_DIR/training.json, and passing it back as `--steps N` repeats the recipe.

Recipe, chosen for sample efficiency in a few minutes:
- each training sequence is one image followed by up to `--qas` question/answer turns (the image is the expensive
  part, so every image pays for ten answers); evaluation asks one question per image, as the first turn does;
- loss on the assistant answers (and their end-of-turn token) only, plus transformers' router load-balancing loss;
- the tokenizer is a byte-level BPE trained on the task's own vocabulary, so every answer is a single token.

The model: 8 MoE layers, 32 experts, top-4, hidden 192, expert width 48 (about 10 M parameters, ~20 MB in bf16),
vision tower of depth 4 with DeepStack, patch 16 merged 2x2 (one LLM token per 32x32 pixels).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.evaluation import shapes_vqa as sv  # noqa: E402
from vismmoe_edge.evaluation.scoring import Scoreboard  # noqa: E402
from vismmoe_edge.prompt import build_messages  # noqa: E402
from vismmoe_edge.testing.tiny_qwen3_vl_moe import (  # noqa: E402
    CHAT_TEMPLATE,
    build_offline_processor,
    build_offline_tokenizer,
    tiny_config,  # noqa: E402
)

MIN_PIXELS = 32 * 32 * 4
MAX_PIXELS = 32 * 32 * 1089  # the largest Shapes-VQA image (1056 x 1056) passes unresized
TOKENIZER_VOCAB = 700


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer, processor, config


def task_corpus(seed: int = 0, n_scenes: int = 400) -> list[str]:
    """Questions and answers of throwaway scenes, plus bare answers: BPE then merges every answer word whole."""
    rng = random.Random(f"tokenizer:{seed}")
    lines: list[str] = []
    for _ in range(n_scenes):
        scene, qas = sv.make_example(rng, shifted=rng.random() < 0.2)
        lines += [qa.question for qa in qas]
        lines += [qa.answer for qa in qas]
        lines += [CAPTION_QUESTION, caption(scene)]
    words = list(sv.PALETTE) + list(sv.SHAPES) + list(sv.WORDS) + [str(d) for d in range(10)] + ["yes", "no"]
    lines += words * 20  # bare, as they follow "assistant\n" (no leading space)
    lines += ["user", "assistant", "system", "You are a helpful assistant.", "Describe the image."] * 20
    return lines


def build_processor():
    tokenizer = build_offline_tokenizer(corpus=task_corpus(), vocab_size=TOKENIZER_VOCAB)
    return build_offline_processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, tokenizer=tokenizer)


def model_config(tokenizer) -> Qwen3VLMoeConfig:
    """The shipped model's shape: demo.tiny_config, widened (see the module docstring)."""
    return tiny_config(
        num_layers=8,
        num_experts=32,
        top_k=4,
        hidden=192,
        moe_intermediate=48,
        tokenizer=tokenizer,
        head_dim=48,
        intermediate_size=4 * 192,  # dense MLP; unused (no mlp_only_layers)
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100_000.0,
            "mrope_section": [8, 8, 8],  # sums to head_dim // 2
            "mrope_interleaved": True,
        },
        vision_overrides={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 4,
            "num_position_embeddings": 1024,  # a 32x32 grid, interpolated to each image
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Data


CAPTION_QUESTION = "List the objects from left to right."


def caption(scene: sv.Scene) -> str:
    """Every object, left to right, as "colour shape [text]": dense supervision that grounds the vision tower."""
    parts = []
    for obj in sorted(scene.objects, key=lambda o: o.x):
        parts.append(f"{obj.color} {obj.shape}" + (f" {obj.text}" if obj.text else ""))
    return ", ".join(parts)


def training_qas(scene: sv.Scene, rng: random.Random, limit: int) -> list[sv.QA]:
    """Up to `limit` turns about one scene: questions with families interleaved so none dominates (counts are
    plentiful), then the caption. The caption comes last because it states every answer: anywhere earlier, the
    later answers can be copied from its text instead of found in the image (attempts 2 and 4 learned that)."""
    qas = sv.questions_for(scene, rng) + sv._existence_qas(scene, rng) + sv._existence_qas(scene, rng)
    by_family: dict[str, list[sv.QA]] = defaultdict(list)
    for qa in qas:
        if qa.question not in {q.question for q in by_family[qa.family]}:
            by_family[qa.family].append(qa)
    for group in by_family.values():
        rng.shuffle(group)
    families = list(by_family)
    rng.shuffle(families)
    picked: list[sv.QA] = []
    describe = sv.QA(CAPTION_QUESTION, caption(scene), "caption")
    while len(picked) < limit - 1 and any(by_family.values()):
        for family in families:
            if by_family[family] and len(picked) < limit - 1:
                picked.append(by_family[family].pop())
    return picked + [describe]


TEXT_CLASSES = [str(d) for d in range(10)] + list(sv.WORDS)
AUX_CLASSES = (len(sv.PALETTE) + 1, len(sv.SHAPES) + 1, len(TEXT_CLASSES) + 1)  # class 0 = nothing there


def _cell_share(mask: np.ndarray, grid: tuple[int, int, int, int]) -> torch.Tensor:
    """Share of True pixels in each cell of a crop shaped (rows, cell, cols, cell)."""
    return torch.from_numpy(mask.reshape(grid).mean(axis=(1, 3)))


def token_labels(scene: sv.Scene, image) -> torch.Tensor:
    """[tokens, 3] labels (colour, shape, text) of each 32x32-pixel visual token, in the raster order the vision
    tower emits merged tokens, from the rendered pixels: an object labels the cells where at least a fifth of the
    pixels are its exact colour; a text labels the cells that hold its ink. A dense auxiliary target for the
    vision tower; the auxiliary head is thrown away after training."""
    px = np.asarray(image, dtype=np.uint8)
    rows, cols = scene.height // sv.TOKEN_PX, scene.width // sv.TOKEN_PX
    labels = torch.zeros(rows, cols, 3, dtype=torch.long)
    colors, shapes, cell = list(sv.PALETTE), list(sv.SHAPES), sv.TOKEN_PX

    for obj in scene.objects:
        # The object's box, widened to whole cells; only that crop is examined.
        x0, y0, x1, y1 = obj.box()
        r0, r1 = max(0, y0 // cell), min(rows, y1 // cell + 1)
        c0, c1 = max(0, x0 // cell), min(cols, x1 // cell + 1)
        crop = px[r0 * cell : r1 * cell, c0 * cell : c1 * cell]
        ys = np.arange(r0 * cell, r1 * cell).reshape(-1, 1)
        grid = (r1 - r0, cell, c1 - c0, cell)
        body = _cell_share((crop == sv.PALETTE[obj.color]).all(-1), grid) >= 0.2
        labels[r0:r1, c0:c1, 0][body] = colors.index(obj.color) + 1
        labels[r0:r1, c0:c1, 1][body] = shapes.index(obj.shape) + 1
        if obj.text is not None:
            ink = _cell_share((crop == sv.TEXT_RGB).all(-1) & (ys > obj.y + obj.radius), grid) >= 0.03
            labels[r0:r1, c0:c1, 2][ink] = TEXT_CLASSES.index(obj.text) + 1
    return labels.view(-1, 3)


def encode_conversation(processor, image, qas: list[sv.QA]) -> dict[str, torch.Tensor]:
    """One image, then Q/A turns; labels are the answer tokens and their <|im_end|>, -100 elsewhere.

    Pixels come back patchified but not rescaled or normalised, as uint8: a quarter of the bytes through the
    loader's shared memory (it was the bottleneck); `normalize_pixels` finishes the job on the GPU."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": qas[0].question}]}]
    messages.append({"role": "assistant", "content": qas[0].answer})
    for qa in qas[1:]:
        messages += [{"role": "user", "content": qa.question}, {"role": "assistant", "content": qa.answer}]
    text = processor.apply_chat_template(messages, tokenize=False)
    enc = processor(text=[text], images=[image], return_tensors="pt", do_rescale=False, do_normalize=False)
    ids = enc["input_ids"][0]
    labels = torch.full_like(ids, -100)
    tok = processor.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tok("assistant\n", add_special_tokens=False)["input_ids"]
    i = 0
    n = len(ids)
    while i < n:
        if ids[i] == im_start and ids[i + 1 : i + 1 + len(header)].tolist() == header:
            j = i + 1 + len(header)
            while j < n and ids[j] != im_end:
                labels[j] = ids[j]
                j += 1
            if j < n:
                labels[j] = ids[j]
            i = j
        i += 1
    return {
        "input_ids": ids,
        "labels": labels,
        "mm_token_type_ids": enc["mm_token_type_ids"][0],
        "pixel_values": enc["pixel_values"].to(torch.uint8),
        "image_grid_thw": enc["image_grid_thw"],
    }


def normalize_pixels(raw: torch.Tensor) -> torch.Tensor:
    """The processor's rescale (1/255) and normalise (mean 0.5, std 0.5), applied to uint8 patches."""
    return (raw.float() * (1 / 255) - 0.5) / 0.5


SMALL_SIDES = tuple(side for side in sv.SIDES if side <= 640)  # 196-400 visual tokens


class TrainStream(IterableDataset):
    """An endless stream of training conversations from the train seed; each worker draws its own substream.

    While `small_phase` (shared with the training loop) is 1, images are at most 640 px a side: cheaper steps,
    and fewer tokens to search while the model learns to look; then the full size range."""

    def __init__(self, seed: int, qas_per_image: int):
        self.seed = seed
        self.qas_per_image = qas_per_image
        self.processor = build_processor()
        self.small_phase = multiprocessing.Value("b", 1)

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        train_seed = sv.SPLITS["train"][0]
        for i in range(10**12):
            rng = random.Random(f"{train_seed}:stream:{self.seed}:{worker}:{i}")
            scene = sv.make_scene(rng, sides=SMALL_SIDES if self.small_phase.value else sv.SIDES)
            qas = training_qas(scene, rng, self.qas_per_image)
            image = sv.render(scene)
            sample = encode_conversation(self.processor, image, qas)
            sample["token_labels"] = token_labels(scene, image)
            yield sample


def collate(batch: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    token_types = torch.zeros((len(batch), n), dtype=torch.long)
    for row, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[row, :k], labels[row, :k], mask[row, :k] = b["input_ids"], b["labels"], 1
        token_types[row, :k] = b["mm_token_type_ids"]
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "mm_token_type_ids": token_types,
        "pixel_values": torch.cat([b["pixel_values"] for b in batch]),
        "image_grid_thw": torch.cat([b["image_grid_thw"] for b in batch]),
        "token_labels": torch.cat([b["token_labels"] for b in batch]),
    }


class AuxiliaryHead(torch.nn.Module):
    """Linear probes on the vision tower's merged tokens (its `merger` output): colour, shape and text of what
    each token covers. A forward hook catches the merger's output during the normal model forward."""

    def __init__(self, model: Qwen3VLMoeForConditionalGeneration) -> None:
        super().__init__()
        width = model.config.text_config.hidden_size
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, n) for n in AUX_CLASSES)
        self.features: torch.Tensor | None = None
        model.model.visual.merger.register_forward_hook(self._catch)

    def _catch(self, module, args, output) -> None:
        self.features = output

    def loss(self, labels: torch.Tensor) -> torch.Tensor:
        feats = self.features.float()
        if feats.shape[0] != labels.shape[0]:
            raise RuntimeError(f"{feats.shape[0]} merged tokens but {labels.shape[0]} token labels")
        return sum(torch.nn.functional.cross_entropy(head(feats), labels[:, i]) for i, head in enumerate(self.heads))


# ---------------------------------------------------------------------------------------------------------------
# Training and a quick GPU evaluation


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def dense_experts_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Every expert on every token as two large matmuls, mixed by the router weights (zero for experts a token
    was not routed to). Same outputs and gradients as the sparse loop, but a handful of kernel launches instead
    of thousands: a training step of this tiny model was bound by launch overhead
    (tools/training/profile_train_step.py)."""
    tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = self.gate_up_proj.shape
    weights = torch.zeros(tokens, num_experts, device=hidden.device, dtype=top_k_weights.dtype)
    weights.scatter_(1, top_k_index, top_k_weights)
    gate_up = (hidden @ self.gate_up_proj.reshape(num_experts * two_i, hidden_size).T).view(tokens, num_experts, two_i)
    gate, up = gate_up.chunk(2, dim=-1)
    inner = self.act_fn(gate) * up * weights.unsqueeze(-1).to(gate.dtype)  # [T, E, I]
    down = self.down_proj.transpose(1, 2).reshape(num_experts * (two_i // 2), hidden_size)  # [E*I, H]
    return (inner.reshape(tokens, -1) @ down.to(inner.dtype)).to(hidden.dtype)


def use_dense_experts(model: Qwen3VLMoeForConditionalGeneration) -> None:
    for layer in model.model.language_model.layers:
        layer.mlp.experts.forward = dense_experts_forward.__get__(layer.mlp.experts)


def pick_experts_implementation(model: Qwen3VLMoeForConditionalGeneration, device: torch.device) -> str:
    """grouped_mm where the kernel takes our fp32 master weights under autocast; else transformers' fallback."""
    for impl in ("grouped_mm", "batched_mm", "eager"):
        model.set_experts_implementation(impl)
        try:
            x = torch.randn(2, 16, model.config.text_config.hidden_size, device=device, requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.model.language_model.layers[0].mlp(x)
            out.float().sum().backward()
            return impl
        except Exception as exc:  # noqa: BLE001 - any failure means "try the next implementation"
            print(f"experts implementation {impl} unusable: {type(exc).__name__}: {exc}"[:200])
    raise RuntimeError("no experts implementation works on this device")


@torch.no_grad()
def quick_eval(model, processor, split: str, n: int, device: torch.device) -> dict[str, float]:
    """Greedy answers to the first `n` examples of a split (one question per image, as `vismmoe-edge eval`)."""
    seed, _ = sv.SPLITS[split]
    board = Scoreboard()
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for ex in tqdm(sv.generate_split(split, n, seed, shifted=split in sv.SHIFTED_SPLITS), desc=f"eval {split}"):
        text = processor.apply_chat_template(build_messages(ex.question, 1), tokenize=False, add_generation_prompt=True)
        enc = processor(text=[text], images=[sv.render(ex.scene)], return_tensors="pt").to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(**enc, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        answer = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        board.add(ex.family, answer, ex.answer)
    return board.accuracy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", default="auto", help="optimizer steps, or 'auto' to fit --minutes")
    parser.add_argument("--minutes", type=float, default=6.5, help="training time budget for --steps auto")
    parser.add_argument("--batch", type=int, default=24, help="images per step")
    parser.add_argument("--qas", type=int, default=14, help="question/answer turns per image")
    parser.add_argument("--small-first", type=float, default=0.3, help="share of steps on images <= 640 px")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--eval-n", type=int, default=100, help="examples per split in the closing GPU check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--aux-weight", type=float, default=0.5, help="weight of the per-token auxiliary loss")
    parser.add_argument("--dense-experts", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    processor = build_processor()
    tok = processor.tokenizer
    config = model_config(tok)
    model = Qwen3VLMoeForConditionalGeneration(config).to(device).train()
    if args.dense_experts:
        use_dense_experts(model)
        impl = "dense (training only; the saved model routes sparsely)"
    else:
        impl = pick_experts_implementation(model, device) if device.type == "cuda" else "eager"
        model.set_experts_implementation(impl)
    aux = AuxiliaryHead(model).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M ({2 * n_params / 1e6:.1f} MB in bf16), experts: {impl}")

    named = list(model.named_parameters()) + list(aux.named_parameters(prefix="aux"))
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in named if p.ndim < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        fused=device.type == "cuda",
    )
    stream = TrainStream(args.seed, args.qas)
    stream.small_phase.value = int(args.small_first > 0)
    loader = DataLoader(
        stream,
        batch_size=args.batch,
        num_workers=args.workers,
        collate_fn=lambda b: collate(b, tok.pad_token_id),
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if args.workers else None,
        persistent_workers=bool(args.workers),
    )
    batches = iter(loader)
    total = 10**9 if args.steps == "auto" else int(args.steps)
    log: list[dict[str, float]] = []
    t_start = time.perf_counter()
    t_probe = None
    bar = tqdm(total=None if args.steps == "auto" else total, desc="train", mininterval=5)
    step = 0
    data_wait = 0.0
    while step < total:
        t_wait = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        data_wait += time.perf_counter() - t_wait
        batch["pixel_values"] = normalize_pixels(batch["pixel_values"])
        labels = batch.pop("token_labels")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total if total < 10**9 else 4000, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(**batch, output_router_logits=True)
            aux_loss = aux.loss(labels)
        (out.loss + args.aux_weight * aux_loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        if step % 25 == 0 or step == 1:
            entry = {
                "step": step,
                "loss": out.loss.item(),
                "aux_loss": out.aux_loss.item(),
                "token_loss": aux_loss.item(),
                "grad_norm": grad_norm.item(),
                "lr": opt.param_groups[0]["lr"],
                "seconds": time.perf_counter() - t_start,
                "data_wait_seconds": data_wait,
            }
            log.append(entry)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", tok=f"{entry['token_loss']:.3f}", wait=f"{data_wait:.0f}s")
        if args.steps == "auto" and step == 30:
            t_probe = time.perf_counter()
        if args.steps == "auto" and step == 130:
            # small-image steps are cheaper; full-size ones cost ~1.25x as much on the H200 (attempt 5)
            per_step = (time.perf_counter() - t_probe) / 100
            small = args.small_first if stream.small_phase.value else 0.0
            total = int(args.minutes * 60 / (per_step * (small + 1.3 * (1 - small))))
            print(f"\n{per_step * 1000:.0f} ms/step -> {total} steps in {args.minutes} min")
        if stream.small_phase.value and step >= args.small_first * total:
            stream.small_phase.value = 0  # batches already queued by workers still hold small images
    bar.close()
    train_seconds = time.perf_counter() - t_start
    print(f"trained {step} steps in {train_seconds:.0f} s")

    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dense_experts:  # back to transformers' own sparse experts for evaluation and saving
        for layer in model.model.language_model.layers:
            del layer.mlp.experts.forward
    model.eval().to(torch.bfloat16)  # saved before the check, so a time-out during it loses nothing
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, max_shard_size="16MB")
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(out_dir)
    scores = {s: quick_eval(model, processor, s, args.eval_n, device) for s in ("validation", "shifted")}
    print(json.dumps(scores, indent=1))
    record = {
        "recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "experts_implementation": impl,
        "parameters": n_params,
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "gpu_quick_eval": scores,
        "log": log,
    }
    (out_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
