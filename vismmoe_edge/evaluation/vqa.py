"""What `vismmoe-edge eval` computes: exact-match VQA accuracy per question family, plus expert traffic.

Data come from the built-in Shapes-VQA generator (rendered in memory, nothing written) or from a user folder of
images with a JSONL file of {"image", "question", "answer"[, "family"][, "id"]} records.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.evaluation.routing_stats import RoutingCounter, usage_summary
from vismmoe_edge.evaluation.scoring import Scoreboard
from vismmoe_edge.prompt import load_image
from vismmoe_edge.sampling import SamplingConfig

BENCHMARKS = ("shapes-vqa",)
SHAPES_SPLITS = ("test", "shifted", "validation", "train")


@dataclass
class VQAItem:
    id: str
    question: str
    answer: str
    family: str
    image: Path | None = None  # a file, loaded when the item is evaluated
    render: Callable[[], Image.Image] | None = None  # or an image drawn on demand

    def load(self) -> Image.Image:
        return self.render() if self.render is not None else load_image(self.image)


def shapes_vqa_items(split: str, limit: int | None = None) -> list[VQAItem]:
    from vismmoe_edge.evaluation import shapes_vqa as sv

    if split not in SHAPES_SPLITS:
        raise VismmoeError(f"unknown split {split!r}; choose one of {', '.join(SHAPES_SPLITS)}")
    seed, size = sv.SPLITS[split]
    n = size if limit is None else min(limit, size)
    items = []
    for ex in sv.generate_split(split, n, seed, shifted=split in sv.SHIFTED_SPLITS):
        items.append(VQAItem(ex.id, ex.question, ex.answer, ex.family, render=lambda s=ex.scene: sv.render(s)))
    return items


def load_items(
    benchmark: str | None, split: str, data: Path | None, questions: Path | None = None, limit: int | None = None
) -> list[VQAItem]:
    """A user folder when `data` is given, else the built-in benchmark's split."""
    if data is not None:
        return folder_items(data, questions, limit)
    if benchmark not in BENCHMARKS:
        raise VismmoeError(f"unknown benchmark {benchmark!r}; built in: {', '.join(BENCHMARKS)}")
    return shapes_vqa_items(split, limit)


def folder_items(folder: Path, questions: Path | None = None, limit: int | None = None) -> list[VQAItem]:
    """Read and check a user data set up front, so that a bad line fails before any model time is spent."""
    folder = Path(folder)
    if not folder.is_dir():
        raise VismmoeError(f"{folder}: data folder not found")
    questions = Path(questions) if questions is not None else folder / "questions.jsonl"
    if not questions.is_file():
        raise VismmoeError(f"{questions}: questions file not found (JSONL, one {{image, question, answer}} per line)")
    items: list[VQAItem] = []
    for number, line in enumerate(questions.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{questions}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise VismmoeError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise VismmoeError(f"{where}: expected a JSON object with image, question and answer")
        for key in ("image", "question", "answer"):
            if not isinstance(record.get(key), str) or not record[key].strip():
                raise VismmoeError(f"{where}: field {key!r} must be a non-empty string")
        image = Path(record["image"])
        image = image if image.is_absolute() else folder / image
        if not image.is_file():
            raise VismmoeError(f"{where}: image {image} not found")
        family = record.get("family") if isinstance(record.get("family"), str) else "all"
        items.append(VQAItem(str(record.get("id", number)), record["question"], record["answer"], family, image))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise VismmoeError(f"{questions}: no questions in the file")
    return items


@dataclass
class EvalReport:
    accuracy: dict[str, float]
    counts: dict[str, int]
    routing: dict[str, Any]
    experts: dict[str, float]
    seconds: float
    prefill_ms_median: float
    visual_tokens_mean: float
    kept_visual_tokens_mean: float
    compression: str
    predictions: list[dict[str, Any]] = field(default_factory=list)
    # where a question's time goes: image (drawn or read) and processor, prefill, decode; means in ms
    prep_ms_mean: float = 0.0
    prefill_ms_mean: float = 0.0
    decode_ms_mean: float = 0.0
    threads: int | None = None  # CPU intra-op threads the run used

    @property
    def seconds_per_question(self) -> float:
        return self.seconds / max(1, self.counts.get("overall", 0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "accuracy": self.accuracy,
            "counts": self.counts,
            "routing": self.routing,
            "experts": self.experts,
            "seconds": round(self.seconds, 2),
            "seconds_per_question": round(self.seconds_per_question, 3),
            "prefill_ms_median": round(self.prefill_ms_median, 2),
            "prefill_ms_mean": round(self.prefill_ms_mean, 2),
            "prep_ms_mean": round(self.prep_ms_mean, 2),
            "decode_ms_mean": round(self.decode_ms_mean, 2),
            "threads": self.threads,
            "visual_tokens_mean": round(self.visual_tokens_mean, 1),
            "kept_visual_tokens_mean": round(self.kept_visual_tokens_mean, 1),
            "compression": self.compression,
        }


def choose_threads(threads: str, device: str) -> int | None:
    """Intra-op threads for a CPU run; None leaves torch's setting (a GPU run, or threads "default").

    "auto": torch's default (one per core), less the cores other processes keep busy (the 1-minute load average,
    rounded), at least one. torch's threads meet at the end of every parallel region, so one thread that shares its
    core with another process stalls them all: on this project's 2-core machine, one busy neighbour made 2-thread
    eval 3x slower (642 against 219 ms a question) where 1 thread gave 326 ms (docs/training/README.md)."""
    import torch

    if threads == "default" or (device != "cpu" and not (device == "auto" and not torch.cuda.is_available())):
        return None
    if threads != "auto":
        try:
            count = int(threads)
        except ValueError:
            raise VismmoeError(f"--threads {threads!r}: use auto, default or a number") from None
        if count < 1:
            raise VismmoeError(f"--threads {threads!r}: at least 1")
        return count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = math.floor(os.getloadavg()[0] + 0.5) if hasattr(os, "getloadavg") else 0
    return max(1, min(torch.get_num_threads(), cores - busy))


def evaluate(
    engine: Any,
    items: list[VQAItem],
    *,
    max_new_tokens: int = 8,
    on_prediction: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> EvalReport:
    """Greedy answers, one question per image, scored by normalised exact match."""
    from tqdm import tqdm

    counter = RoutingCounter(engine.experts, engine.catalogue.moe_layers, engine.catalogue.num_experts)
    board = Scoreboard()
    totals: dict[str, float] = {}
    prefill_ms: list[float] = []
    prep_ms: list[float] = []
    decode_ms: list[float] = []
    visual_tokens: list[int] = []
    kept_tokens: list[int] = []
    image_token = engine.model.config.image_token_id
    start = time.perf_counter()
    try:
        for item in tqdm(items, desc="eval", unit="q", disable=not progress):
            t_item = time.perf_counter()
            inputs = engine.encode(item.question, [item.load()])
            prep_ms.append((time.perf_counter() - t_item) * 1000)
            result = engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=max_new_tokens))
            ok = board.add(item.family, result.text, item.answer)
            prefill_ms.append(result.timings.prefill_s * 1000)
            decode_ms.append(getattr(result.timings, "decode_s", 0.0) * 1000)
            visual_tokens.append(int((inputs.input_ids == image_token).sum()))
            kept = result.compression.kept_visual_tokens if result.compression is not None else None
            kept_tokens.append(visual_tokens[-1] if kept is None else kept)
            for key, value in result.experts.items():
                if key in ("hits", "misses", "bytes_read", "stall_s"):
                    totals[key] = totals.get(key, 0.0) + value
            record = {"id": item.id, "family": item.family, "question": item.question, "answer": item.answer}
            record.update(prediction=result.text.strip(), correct=ok, prefill_ms=round(prefill_ms[-1], 1))
            if on_prediction is not None:
                on_prediction(record)
    finally:
        engine.experts.route_hooks.remove(counter._on_route)
    lookups = totals.get("hits", 0.0) + totals.get("misses", 0.0)
    totals["hit_rate"] = totals.get("hits", 0.0) / lookups if lookups else 0.0
    return EvalReport(
        accuracy=board.accuracy(),
        counts=board.counts(),
        routing=usage_summary(counter.counts),
        experts=totals,
        seconds=time.perf_counter() - start,
        prefill_ms_median=statistics.median(prefill_ms),
        visual_tokens_mean=statistics.fmean(visual_tokens),
        kept_visual_tokens_mean=statistics.fmean(kept_tokens),
        compression=engine.compression.method,
        prep_ms_mean=statistics.fmean(prep_ms),
        prefill_ms_mean=statistics.fmean(prefill_ms),
        decode_ms_mean=statistics.fmean(decode_ms),
    )


def format_report(report: EvalReport, title: str) -> Iterator[str]:
    from vismmoe_edge.units import format_bytes

    yield f"{title}: {report.accuracy['overall']:.1%} exact match over {report.counts['overall']} questions"
    for family, acc in report.accuracy.items():
        if family != "overall":
            yield f"  {family:<10} {acc:6.1%}  ({report.counts[family]})"
    r, x = report.routing, report.experts
    yield (
        f"routing: the top 25% of experts take {r['top25_share_mean']:.1%} of activations per layer on average "
        f"(uniform: 25%); per layer: {', '.join(f'{s:.0%}' for s in r['top25_share_per_layer'])}"
    )
    yield (
        f"experts: {x['hit_rate']:.1%} hit rate, {format_bytes(x.get('bytes_read', 0))} read | "
        f"{report.visual_tokens_mean:.0f} visual tokens on average"
        f" ({report.kept_visual_tokens_mean:.0f} kept by {report.compression})"
    )
    threads = "" if report.threads is None else f", {report.threads} CPU thread{'s' if report.threads != 1 else ''}"
    yield (
        f"time: {report.seconds:.0f} s in all, {report.seconds_per_question * 1000:.0f} ms a question: "
        f"image and processor {report.prep_ms_mean:.0f} ms, prefill {report.prefill_ms_mean:.0f} ms "
        f"(median {report.prefill_ms_median:.0f}), decode {report.decode_ms_mean:.0f} ms{threads}"
    )
