"""Counters the daemon keeps, and /metrics in Prometheus' text format; gauges are read when scraped."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from vismmoe_edge.hardware.system import mem_available_bytes

if TYPE_CHECKING:
    from vismmoe_edge.serve.protocol import Completion

Sample = tuple[str, str, str, list[tuple[dict[str, str], float]]]  # name, type, help, [(labels, value)]


class Metrics:
    """Counters kept by the server; gauges are read live when /metrics is scraped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.responses: Counter[str] = Counter()  # chat completions by HTTP status ("499": client left first)
        self.cancelled: Counter[str] = Counter()  # client_disconnect, deadline, shutdown
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.generation_s = 0.0
        self.last_decode_tps = 0.0
        self.last_prefill_s = 0.0
        self.expert = {"hits": 0, "misses": 0, "bytes_read": 0, "stall_s": 0.0}
        self.reloads = 0
        self.plan_differs = False  # the last SIGHUP re-plan disagreed with what is loaded
        self.completed = 0
        self.mean_request_s = 0.0  # exponential average: Retry-After estimates

    def record_response(self, status: int | str) -> None:
        with self.lock:
            self.responses[str(status)] += 1

    def record_cancel(self, reason: str) -> None:
        with self.lock:
            self.cancelled[reason] += 1

    def record_generation(self, completion: Completion, seconds: float) -> None:
        with self.lock:
            self.prompt_tokens += completion.prompt_tokens
            self.generated_tokens += completion.completion_tokens
            self.generation_s += seconds
            self.last_decode_tps = completion.timings.get("decode_tokens_per_s", 0.0)
            self.last_prefill_s = completion.timings.get("prefill_s", 0.0)
            self.completed += 1
            weight = 0.3 if self.completed > 1 else 1.0
            self.mean_request_s += weight * (seconds - self.mean_request_s)

    def absorb_expert_stats(self, pipeline: Any) -> dict[str, float]:
        """Move the pipeline's per-request counters into our totals and reset them (its layer log grows)."""
        with self.lock:
            stats = pipeline.stats.as_dict()
            for key in self.expert:
                self.expert[key] += stats[key]
            pipeline.reset_stats()
        return stats


def prometheus(samples: list[Sample]) -> str:
    """Text exposition format 0.0.4 from (name, type, help, [(labels, value)])."""
    lines = []
    for name, kind, help_text, values in samples:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in values:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            number = repr(float(value)) if isinstance(value, float) else str(int(value))
            lines.append(f"{name}{{{label_text}}} {number}" if label_text else f"{name} {number}")
    return "\n".join(lines) + "\n"


def process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def rss_anon_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def prefix_cache_samples(cache: Any) -> list[Sample]:
    """The prefix cache's counters (prefix_cache.py); none when it is off."""
    if cache is None:
        return []
    s = cache.stats()
    kinds = [({"kind": "prefix"}, s.prefix_hits), ({"kind": "vision"}, s.vision_hits)]
    missed = [({"kind": "prefix"}, s.prefix_misses), ({"kind": "vision"}, s.vision_misses)]
    return [
        ("vismmoe_prefix_cache_hits_total", "counter", "requests that reused a cached prompt prefix or images", kinds),
        ("vismmoe_prefix_cache_misses_total", "counter", "requests that found nothing to reuse", missed),
        ("vismmoe_prefix_cache_reused_tokens_total", "counter", "prompt tokens not prefilled", [({}, s.reused_tokens)]),
        (
            "vismmoe_prefix_cache_seen_frames_total",
            "counter",
            "images taken by their encoded bytes, neither decoded nor processed",
            [({}, s.frame_hits)],
        ),
        (
            "vismmoe_prefix_cache_evictions_total",
            "counter",
            "entries evicted, least recently used",
            [({}, s.evictions)],
        ),
        ("vismmoe_prefix_cache_bytes", "gauge", "bytes the prefix cache holds", [({}, s.bytes)]),
        ("vismmoe_prefix_cache_capacity_bytes", "gauge", "--prefix-cache-bytes", [({}, s.capacity_bytes)]),
        ("vismmoe_prefix_cache_entries", "gauge", "entries held (images and prefixes)", [({}, s.entries)]),
    ]


def host_mem_available() -> int:
    """MemAvailable, or 0 where /proc/meminfo cannot be read (a gauge must not fail a scrape)."""
    try:
        return mem_available_bytes()
    except (OSError, ValueError):
        return 0


def render(
    m: Metrics,
    *,
    up: bool,
    live: Any,
    queue_depth: int,
    queue_capacity: int,
    in_flight: int,
    started: float,
    extra: list[Sample] | None = None,
) -> str:
    """/metrics: our totals plus the pipeline's counters of the request in flight (`live`, or None)."""
    with m.lock:
        hits = m.expert["hits"] + (live.hits if live else 0)
        misses = m.expert["misses"] + (live.misses if live else 0)
        bytes_read = m.expert["bytes_read"] + (live.bytes_read if live else 0)
        stall = m.expert["stall_s"] + (live.stall_s if live else 0.0)
        samples: list[Sample] = [
            ("vismmoe_up", "gauge", "1 once the model is loaded and requests are accepted", [({}, float(up))]),
            (
                "vismmoe_requests_total",
                "counter",
                "chat completions answered, by HTTP status (499: client left)",
                [({"status": s}, n) for s, n in sorted(m.responses.items())],
            ),
            (
                "vismmoe_requests_cancelled_total",
                "counter",
                "generations cut short, by reason",
                [({"reason": r}, m.cancelled[r]) for r in ("client_disconnect", "deadline", "shutdown")],
            ),
            ("vismmoe_prompt_tokens_total", "counter", "prompt tokens processed", [({}, m.prompt_tokens)]),
            ("vismmoe_generated_tokens_total", "counter", "tokens generated", [({}, m.generated_tokens)]),
            ("vismmoe_generation_seconds_total", "counter", "seconds spent generating", [({}, m.generation_s)]),
            ("vismmoe_decode_tokens_per_second", "gauge", "decode speed of the last reply", [({}, m.last_decode_tps)]),
            ("vismmoe_prefill_seconds", "gauge", "prefill time of the last request", [({}, m.last_prefill_s)]),
            ("vismmoe_expert_hits_total", "counter", "expert lookups served from memory", [({}, hits)]),
            ("vismmoe_expert_misses_total", "counter", "expert lookups that waited for a read", [({}, misses)]),
            (
                "vismmoe_expert_hit_rate",
                "gauge",
                "hits / (hits + misses) since start",
                [({}, hits / (hits + misses) if hits + misses else 0.0)],
            ),
            ("vismmoe_expert_bytes_read_total", "counter", "expert bytes read from disk", [({}, bytes_read)]),
            ("vismmoe_expert_stall_seconds_total", "counter", "compute time spent waiting for experts", [({}, stall)]),
            (
                "vismmoe_expert_resident_bytes",
                "gauge",
                "expert bytes resident now",
                [({}, live.resident_bytes if live else 0)],
            ),
            ("vismmoe_queue_depth", "gauge", "requests waiting for the worker", [({}, queue_depth)]),
            ("vismmoe_queue_capacity", "gauge", "--max-queue", [({}, queue_capacity)]),
            ("vismmoe_requests_in_flight", "gauge", "requests generating now", [({}, in_flight)]),
            ("vismmoe_profile_reloads_total", "counter", "SIGHUP profile reloads", [({}, m.reloads)]),
            (
                "vismmoe_plan_differs",
                "gauge",
                "1 if the last SIGHUP re-plan differs from the loaded settings (restart to apply)",
                [({}, 1.0 if m.plan_differs else 0.0)],
            ),
        ]
    samples += [
        ("process_resident_memory_bytes", "gauge", "resident set size", [({}, process_rss_bytes())]),
        ("vismmoe_memory_available_bytes", "gauge", "MemAvailable of the host", [({}, host_mem_available())]),
        ("process_start_time_seconds", "gauge", "start time since the epoch", [({}, started)]),
        *(extra or []),
    ]
    return prometheus(samples)
