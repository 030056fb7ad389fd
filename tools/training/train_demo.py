"""Train the shipped demo model (a small Qwen3-VL-MoE) on the Shapes-VQA training stream; resume or start fresh.

    python tools/training/train_demo.py OUT_DIR [--init vismmoe_edge/demo_model|DIR|fresh] [--minutes 6] \
        [--steps auto|N]
    python tools/training/train_demo.py OUT_DIR --smoke        # CPU: a few tiny steps through the whole script

Runs on one CUDA GPU (the H200 of the device tool: tools/training/device_train_demo.sh). By default it resumes from the
shipped checkpoint (weights and tokenizer; the optimizer starts afresh with a warm-up) and appends this run to the
lineage in OUT_DIR/training.json: recipe, seed, step count, data version, the checkpoint it resumed from (with its
digest), throughput and a quick GPU evaluation. `--steps auto` measures the step rate in the first seconds and
fixes the step count that fits `--minutes`; `--steps N --warmup W` with the recorded numbers repeats a run's
schedule.

Recipe (docs/training/README.md says why):
- data (tools/training/train_data.py, DATA_VERSION): whole batches of one image size (buckets) made by worker processes,
  each image followed by `--slots` independent question turns (each sees only the image, as eval asks); half the
  scenes confusable (few colours and shapes); existence balanced yes/no with hard negatives; colour questions
  that name the object by shape and size or position; counts of colour-shape conjunctions;
- loss: cross-entropy on the answer tokens and their <|im_end|>, a per-layer router load-balancing loss (0.01),
  and per-token auxiliary probes on the vision tower's merged tokens (object identity of each 32x32 cell);
- step (tools/training/train_fast.py): static shapes, dense experts, bf16 autocast, fused AdamW, captured as one CUDA
  graph per bucket. The first `--probe-seconds` run plainly (the probe's plain path), then as graphs; the faster
  of the two trains on, and a failed capture turns every later step plain; the log and `--profile-json` say which.

The model: 8 MoE layers, 32 experts, top-4, hidden 192, expert width 48 (10.5 M parameters, 21 MB in bf16), vision
tower of depth 4 with DeepStack, patch 16 merged 2x2 (one LLM token per 32x32 pixels).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_data as D  # noqa: E402
import train_fast as F  # noqa: E402

from vismmoe_edge.demo import TRAINED_DEMO_DIR  # noqa: E402
from vismmoe_edge.evaluation import shapes_vqa as sv  # noqa: E402
from vismmoe_edge.evaluation.scoring import Scoreboard  # noqa: E402
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor  # noqa: E402
from vismmoe_edge.testing.tiny_qwen3_vl_moe import (  # noqa: E402
    CHAT_TEMPLATE,
    build_offline_processor,
    build_offline_tokenizer,
    tiny_config,
)

MIN_PIXELS = 32 * 32 * 4
MAX_PIXELS = 32 * 32 * 1089  # the largest Shapes-VQA image (1056 x 1056) passes unresized
TOKENIZER_VOCAB = 700
MAX_BF16_BYTES = 24_000_000
MAX_SHARD_BYTES = 16_000_000


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer, processor, config (a fresh model); a resumed one keeps its checkpoint's


def task_corpus(seed: int = 0, n_scenes: int = 400) -> list[str]:
    """Questions and answers of throwaway scenes, plus bare answers: BPE then merges every answer word whole."""
    rng = random.Random(f"tokenizer:{seed}")
    lines: list[str] = []
    for _ in range(n_scenes):
        scene, qas = sv.make_example(rng, shifted=rng.random() < 0.2)
        lines += [qa.question for qa in qas]
        lines += [qa.answer for qa in qas]
        lines += ["List the objects from left to right.", caption(scene)]
    words = list(sv.PALETTE) + list(sv.SHAPES) + list(sv.WORDS) + [str(d) for d in range(10)] + ["yes", "no"]
    lines += words * 20  # bare, as they follow "assistant\n" (no leading space)
    lines += ["user", "assistant", "system", "You are a helpful assistant.", "Describe the image."] * 20
    return lines


def caption(scene: sv.Scene) -> str:
    """Every object, left to right (the corpus of the shipped tokenizer included these captions)."""
    parts = [
        f"{o.color} {o.shape}" + (f" {o.text}" if o.text else "") for o in sorted(scene.objects, key=lambda o: o.x)
    ]
    return ", ".join(parts)


def build_processor():
    tokenizer = build_offline_tokenizer(corpus=task_corpus(), vocab_size=TOKENIZER_VOCAB)
    return build_offline_processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, tokenizer=tokenizer)


def model_config(tokenizer) -> Qwen3VLMoeConfig:
    """The shipped model's shape: demo.tiny_config, widened."""
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


def weights_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for shard in sorted(model_dir.glob("*.safetensors")):
        h.update(shard.read_bytes())
    return h.hexdigest()[:16]


CODE_SOURCES = (
    "tools/training/train_demo.py",
    "tools/training/train_data.py",
    "tools/training/train_fast.py",
    "vismmoe_edge/evaluation/shapes_vqa.py",
)


def code_digest() -> str:
    """The training code and data generator this run used (the device copy of the tree has no git history)."""
    h = hashlib.sha256()
    for rel in CODE_SOURCES:
        h.update((ROOT / rel).read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str | None:
    """HEAD, marked when the training sources differ from it: the device's copy of the tree can carry a .git that
    is older than its files (run 2 recorded 08b6ade while training code of 2139638), so only the code digest is
    authoritative."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        diff = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", *CODE_SOURCES], capture_output=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    return None if not commit else commit if diff.returncode == 0 else f"{commit} + uncommitted changes"


def load_init(init: str, device: torch.device) -> tuple[Any, Any, dict[str, Any]]:
    """(model in fp32, processor, where it came from). `fresh`: new weights from --seed, tokenizer rebuilt."""
    if init == "fresh":
        processor = build_processor()
        model = Qwen3VLMoeForConditionalGeneration(model_config(processor.tokenizer))
        return model.to(device), processor, {"init": "fresh"}
    path = Path(init)
    processor = load_processor(path)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    lineage = []
    record_path = path / "training.json"
    if record_path.is_file():
        previous = json.loads(record_path.read_text())
        # format 1 (attempt 6) was one run's record; format 2 holds the list
        lineage = previous["runs"] if "runs" in previous else [dict(previous, run="attempt 6")]
    source = {"init": str(path), "weights_sha256_16": weights_digest(path), "runs_before": len(lineage)}
    return model.to(device), processor, {"source": source, "lineage": lineage}


# ---------------------------------------------------------------------------------------------------------------
# Schedule, profile


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up, then cosine from peak to floor * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def profile_summary(prof: Any, steps: int, wall_s: float, images: int) -> dict[str, Any]:
    """GPU kernel time against host time over a profiled window, and the top kernels and host ops."""

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    events = prof.key_averages()
    gpu_us = sum(device_us(e) for e in events)
    host_us = sum(float(e.self_cpu_time_total) for e in events)
    top_gpu = sorted(events, key=device_us, reverse=True)[:15]
    top_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "steps": steps,
        "images": images,
        "wall_ms_per_step": round(wall_s / steps * 1000, 2),
        "gpu_kernel_ms_per_step": round(gpu_us / steps / 1000, 2),
        "host_op_ms_per_step": round(host_us / steps / 1000, 2),
        "gpu_busy_share": round(gpu_us / 1e6 / wall_s, 3) if wall_s > 0 else None,
        "images_per_s": round(images / wall_s, 1) if wall_s > 0 else None,
        "gpu_kernels_per_step": round(sum(e.count for e in events if device_us(e) > 0) / steps, 1),
        # what the host issued: one cudaGraphLaunch a step for a replayed graph, thousands of kernel launches without
        "host_launch_calls_per_step": {
            e.key: round(e.count / steps, 1)
            for e in events
            if e.key.startswith(("cudaLaunch", "cuLaunch", "cudaGraph"))
        },
        "top_gpu_kernels_ms_per_step": {e.key[:90]: round(device_us(e) / steps / 1000, 3) for e in top_gpu},
        "top_host_ops_ms_per_step": {e.key[:90]: round(e.self_cpu_time_total / steps / 1000, 3) for e in top_host},
    }


class Prefetcher:
    """Next batch copied to the GPU on a side stream while the current step runs; `wait_s` is the time the
    training loop spent waiting for the data workers."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.it = iter(loader)
        self.device = device
        self.stream = torch.cuda.Stream() if device.type == "cuda" else None
        self.wait_s = 0.0
        self.next: dict[str, torch.Tensor] | None = None
        self._load()

    def _load(self) -> None:
        t = time.perf_counter()
        batch = next(self.it)
        self.wait_s += time.perf_counter() - t
        if self.stream is None:
            self.next = batch
            return
        bucket = batch.pop("bucket")  # stays on the host: reading it from the GPU would sync every step
        with torch.cuda.stream(self.stream):
            self.next = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        self.next["bucket"] = bucket

    def get(self) -> dict[str, torch.Tensor]:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            for v in self.next.values():
                if v.is_cuda:
                    v.record_stream(torch.cuda.current_stream())
        batch = self.next
        self._load()
        return batch


# ---------------------------------------------------------------------------------------------------------------
# Quick evaluation


def quick_eval(fast: F.FastModel, split: str, n: int, deadline: float | None) -> dict[str, Any]:
    """Per-family exact match on the first `n` questions of a split, one question per image (as `vismmoe-edge
    eval`), greedy, through the training forward with the saved weights."""
    seed, _ = sv.SPLITS[split]
    examples = sv.generate_split(split, n, seed, shifted=split in sv.SHIFTED_SPLITS)
    start = time.perf_counter()
    answers = F.greedy_answers(
        fast,
        [(e.scene, e.question) for e in examples],
        sv.render,
        autocast=fast.device.type == "cuda",
        deadline=deadline,
    )
    board = Scoreboard()
    for e, a in zip(examples, answers, strict=True):
        if a is not None:
            board.add(e.family, a, e.answer)
    return {"accuracy": board.accuracy(), "counts": board.counts(), "seconds": round(time.perf_counter() - start, 1)}


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--init", default=str(TRAINED_DEMO_DIR), help="checkpoint to resume from, or 'fresh'")
    parser.add_argument("--steps", default="auto", help="optimizer steps, or 'auto' to fit --minutes")
    parser.add_argument("--minutes", type=float, default=6.0, help="training time (probe included) for --steps auto")
    parser.add_argument("--deadline", type=float, default=None, help="wall-clock time (epoch s) training must end by")
    parser.add_argument("--lr", type=float, default=None, help="peak lr (default 1.5e-3 resuming, 3e-3 fresh)")
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--lr-floor", type=float, default=0.1, help="final lr as a share of the peak")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--token-budget", type=int, default=160_000, help="LLM tokens per step (sets each batch)")
    parser.add_argument("--sides", default="448,640,864,1056", help="bucket sides: every width x height pair")
    parser.add_argument("--slots", type=int, default=16, help="question turns per image")
    parser.add_argument("--slot-len", type=int, default=24, help="tokens per turn slot")
    parser.add_argument("--confusable", type=float, default=0.5, help="share of scenes from few colours and shapes")
    parser.add_argument("--background-reuse", type=float, default=4.0, help="mean uses of a rendered background")
    parser.add_argument("--text-boost", type=float, default=0.5, help="chance a label-less object gets a label")
    parser.add_argument("--wide-layout", type=float, default=0.5, help="share of scenes with every split's layouts")
    parser.add_argument("--aux-labels", choices=("object", "cell"), default="object")
    parser.add_argument("--aux-weight", type=float, default=0.5)
    parser.add_argument("--balance-weight", type=float, default=0.01, help="router load-balancing loss weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--step-mode", choices=("auto", "graph", "plain"), default="auto")
    parser.add_argument("--probe-seconds", type=float, default=20.0, help="plain steps first, and graph rate window")
    parser.add_argument("--eval-n", type=int, default=300, help="questions per split in the closing check")
    parser.add_argument("--eval-seconds", type=float, default=100.0, help="time limit of the closing check")
    parser.add_argument("--profile-json", type=Path, default=None, help="write the profile summary here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="CPU: 2 steps of 2 images, 1 bucket, 6 eval questions")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.steps, args.sides, args.token_budget, args.slots = "cpu", "2", "448", 1, 4
        args.workers, args.eval_n, args.warmup, args.probe_seconds = 0, 6, 1, 0.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_launch = time.perf_counter()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    text_masks = D.pin_text_masks()
    model, processor, origin = load_init(args.init, device)
    resumed = args.init != "fresh"
    peak_lr = args.lr if args.lr is not None else (1.5e-3 if resumed else 3e-3)
    encoder = D.TurnEncoder(processor)
    sides = tuple(int(s) for s in args.sides.split(","))
    buckets = D.make_buckets(
        sides, args.token_budget, args.slots, args.slot_len, len(encoder.prefix), 2 if args.smoke else 8
    )
    aux = F.AuxiliaryHead(model.config.text_config.hidden_size).to(device)
    fast = F.FastModel(model, encoder, device, aux, args.aux_weight, args.balance_weight)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M ({2 * n_params / 1e6:.1f} MB in bf16); init: {args.init}; {text_masks}")
    print("buckets: " + ", ".join(f"{b.name}x{b.batch}" for b in buckets) + f"; {args.slots} turns of {args.slot_len}")

    named = list(model.named_parameters()) + list(aux.named_parameters(prefix="aux"))
    params = [p for _, p in named]
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in named if p.ndim < 2 or "embed" in n]
    cuda = device.type == "cuda"
    lr_tensor = torch.tensor(peak_lr / args.warmup, device=device) if cuda else None
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr_tensor if cuda else peak_lr,
        betas=(0.9, 0.98),
        fused=cuda,
        capturable=cuda,
    )
    config = D.StreamConfig(
        args.seed, buckets, args.confusable, args.aux_labels, args.background_reuse, args.text_boost, args.wide_layout
    )
    stream = D.BatchStream(config, processor)
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=cuda,
        prefetch_factor=2 if args.workers else None,
        persistent_workers=bool(args.workers),
    )
    mode = args.step_mode if args.step_mode != "auto" else ("graph" if cuda else "plain")
    runner = F.StepRunner(fast, params, opt, lr_tensor, "plain")
    prefetch = Prefetcher(loader, device)
    total = 10**9 if args.steps == "auto" else int(args.steps)
    budget_s = args.minutes * 60
    deadline = time.time() + budget_s if args.deadline is None else min(args.deadline, time.time() + budget_s)

    log: list[dict[str, Any]] = []
    phases: dict[str, dict[str, Any]] = {}
    profiles: dict[str, Any] = {}
    step = images = 0
    t_train = time.perf_counter()
    phase, phase_t, phase_step, phase_images, phase_wait = "plain", t_train, 0, 0, prefetch.wait_s
    last_log_step, last_totals = 0, runner.totals.clone()
    prof, prof_t, prof_step, prof_images = None, 0.0, 0, 0
    profile_at = 3 if cuda else -1  # the plain phase's 4th step, and the graph phase's once all are captured
    plain_mark: tuple[float, int, int] | None = None
    graph_mark: tuple[float, int, int] | None = None
    plain_rate = (0.0, 0.0)  # images/s and s/step of the plain probe
    probe: tuple[float, float] | None = None  # the same for the mode that then trains
    chosen = mode
    stopped_by = "steps"
    good = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}  # the last finite weights
    good_step = 0

    def rate_since(mark: tuple[float, int, int] | None) -> tuple[float, float]:
        """(images/s, seconds/step) since `mark`."""
        if mark is None or step <= mark[1]:
            return 0.0, float("inf")
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - mark[0]
        return (images - mark[2]) / dt, dt / (step - mark[1])

    def switch(old: F.StepRunner, new_mode: str) -> F.StepRunner:
        new = F.StepRunner(fast, params, opt, lr_tensor, new_mode)
        new.totals, new.capture_seconds, new.fallbacks = old.totals, old.capture_seconds, old.fallbacks
        return new

    def close_phase(name: str) -> None:
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - phase_t
        if step > phase_step:
            phases[name] = {
                "steps": step - phase_step,
                "images": images - phase_images,
                "seconds": round(dt, 1),
                "images_per_s": round((images - phase_images) / dt, 1),
                "data_wait_s": round(prefetch.wait_s - phase_wait, 1),
                "max_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
            }
            print(f"{name}: {phases[name]}", flush=True)

    def scheduled(at: int) -> float:
        return lr_at(at, total if total < 10**9 else 4000, peak_lr, args.warmup, args.lr_floor)

    while step < total:
        if time.time() > deadline:
            stopped_by = "time"
            break
        if phase == "plain" and mode == "graph" and time.perf_counter() - t_train > args.probe_seconds and step >= 10:
            close_phase("plain")  # the plain probe is over: the same training continues as CUDA graphs
            plain_rate = rate_since(plain_mark)
            torch.cuda.empty_cache()
            runner = switch(runner, "graph")
            phase, phase_t, phase_step, phase_images, phase_wait = (
                "graph",
                time.perf_counter(),
                step,
                images,
                prefetch.wait_s,
            )
            profile_at = -1  # set again once every bucket has its graph
        batch = prefetch.get()
        index = int(batch.pop("bucket"))
        bucket = buckets[index]
        runner.set_lr(scheduled(step))
        if step == profile_at:
            torch.cuda.synchronize()
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            prof.__enter__()
            prof_t, prof_step, prof_images = time.perf_counter(), step, images
        runner.step(index, bucket, batch)
        step += 1
        images += bucket.batch
        if prof is not None and step - prof_step == 4:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            profiles[phase] = profile_summary(prof, 4, time.perf_counter() - prof_t, images - prof_images)
            print(f"profile ({phase}): " + json.dumps({k: v for k, v in profiles[phase].items() if "top" not in k}))
            prof = None
            if phase == "graph":
                graph_mark = (time.perf_counter(), step, images)  # the steady graph rate is measured from here
        if phase == "plain" and step - phase_step == 7:
            plain_mark = (time.perf_counter(), step, images)  # after warm-up and the profiled steps
        if phase == "graph" and profile_at < 0 and (runner.mode == "plain" or len(runner.graphs) == len(buckets)):
            profile_at = step + 1  # every bucket has its graph (or capture failed): profile the steady state
        # the probes' verdict, once: the graph rate over --probe-seconds of steady replays against the plain rate
        mark = graph_mark if phase == "graph" else plain_mark if mode != "graph" else None
        if probe is None and mark is not None and time.perf_counter() - mark[0] >= args.probe_seconds:
            probe = rate_since(mark)
            if phase != "graph":
                plain_rate = probe
            elif runner.mode == "graph" and plain_rate[0] > 1.05 * probe[0]:
                print(f"plain steps were faster ({plain_rate[0]:.0f} against {probe[0]:.0f} img/s): plain from now")
                close_phase("graph")
                runner = switch(runner, "plain")
                chosen = "plain (faster than the graphs)"
                phase, phase_t, phase_step, phase_images, phase_wait = (
                    "plain after the probe",
                    time.perf_counter(),
                    step,
                    images,
                    prefetch.wait_s,
                )
            per_step = plain_rate[1] if runner.mode == "plain" else probe[1]
            if args.steps == "auto":
                total = step + int(0.97 * (deadline - time.time()) / per_step)
            print(f"probe: {probe[0]:.0f} img/s, {per_step * 1000:.0f} ms/step -> {total} steps in all", flush=True)
        if step % 25 == 0 or step == 1 or step == total:
            now = runner.totals.tolist()
            diff = [a - b for a, b in zip(now, last_totals.tolist(), strict=True)]
            n = step - last_log_step
            entry = {"step": step, "images": images, **{k: diff[i] / n for i, k in enumerate(F.METRICS)}}
            entry.update(
                grad_norm=diff[-1] / n,
                lr=scheduled(step - 1),
                seconds=round(time.perf_counter() - t_train, 1),
                data_wait_s=round(prefetch.wait_s, 1),
                mode=phase,
            )
            log.append(entry)
            last_log_step, last_totals = step, runner.totals.clone()
            if not math.isfinite(entry["loss"]):  # keep the last good weights rather than ship a broken model
                print(f"non-finite loss at step {step}: back to the weights of step {good_step}, training stops")
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(good[name])
                stopped_by = f"non-finite loss at step {step} (weights of step {good_step} kept)"
                break
            if step - good_step >= 100:
                good = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
                good_step = step
            print(
                f"step {step} ({phase}) loss {entry['loss']:.3f} answers {entry['answer_loss']:.3f} "
                f"acc {entry['answer_acc']:.3f} tokens {entry['token_loss']:.3f} balance {entry['balance_loss']:.2f} "
                f"| {images / (time.perf_counter() - t_train):.0f} img/s, waited {prefetch.wait_s:.0f}s",
                flush=True,
            )
    close_phase(phase)
    train_seconds = time.perf_counter() - t_train
    print(f"trained {step} steps ({images} images) in {train_seconds:.0f} s; stopped by {stopped_by}")

    # ---- save (before the check, so a time-out in the check loses nothing) ----
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval().to(torch.bfloat16)
    tok = processor.tokenizer
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, max_shard_size="16MB")
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(out_dir)
    shards = {p.name: p.stat().st_size for p in sorted(out_dir.glob("*.safetensors"))}
    if sum(shards.values()) > MAX_BF16_BYTES or max(shards.values()) > MAX_SHARD_BYTES:
        raise RuntimeError(f"checkpoint over the size limits: {shards}")
    throughput = {
        "phases": phases,
        "step_mode": chosen if not runner.fallbacks else f"{mode}, capture failed: plain from then on",
        "probe_images_per_s": {
            "plain": round(plain_rate[0], 1),
            "graph": round(probe[0], 1) if probe is not None and mode == "graph" else None,
        },
        "graph_capture_seconds": round(runner.capture_seconds, 1),
        "graph_fallbacks": {buckets[i].name: why for i, why in runner.fallbacks.items()},
        "data_wait_seconds": round(prefetch.wait_s, 1),
    }
    run = {
        "run": len(origin.get("lineage", [])) + 1,
        "recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "peak_lr": peak_lr,
        "seed": args.seed,
        "steps": step,
        "warmup": args.warmup,
        "scheduled_steps": total if total < 10**9 else None,
        "stopped_by": stopped_by,
        "images": images,
        "train_seconds": round(train_seconds, 1),
        "data_version": D.DATA_VERSION,
        "text_masks": text_masks,
        "resumed_from": origin.get("source", "fresh"),
        "buckets": [f"{b.name}x{b.batch}" for b in buckets],
        "code": {"git_commit": git_commit(), "code_sha256_16": code_digest()},
        "parameters": n_params,
        "shards": shards,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "throughput": throughput,
        "log": log,
    }
    record = {"format": 2, "runs": origin.get("lineage", []) + [run]}
    (out_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")

    def write_profile() -> None:
        if args.profile_json is not None:
            summary = {"device": run["device"], "torch": run["torch"], "throughput": throughput, "profiles": profiles}
            args.profile_json.parent.mkdir(parents=True, exist_ok=True)
            args.profile_json.write_text(json.dumps(summary, indent=1) + "\n")

    write_profile()  # now, so that a failure in the check below still leaves it

    # ---- quick check on the GPU, with the weights as saved ----
    eval_deadline = time.perf_counter() + args.eval_seconds
    fast.aux = None
    if not cuda:
        model.float()  # CPU has no autocast here: weights and activations in one dtype
    scores = {s: quick_eval(fast, s, args.eval_n, eval_deadline) for s in ("test", "shifted")}
    for split, result in scores.items():
        acc = result["accuracy"]
        families = " ".join(f"{f} {v:.0%}" for f, v in acc.items() if f != "overall")
        print(f"quick eval {split}: {acc['overall']:.1%} of {result['counts']['overall']} ({families})")
    run["gpu_quick_eval"] = scores
    run["wall_seconds"] = round(time.perf_counter() - t_launch, 1)
    (out_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_profile()
    return run


if __name__ == "__main__":
    main()
