"""`vismmoe-edge serve`: a daemon holding one loaded model behind an OpenAI-compatible HTTP API.

Threads: the HTTP server's handler threads parse, validate and enqueue requests, then wait for or relay their
results; one worker thread owns the Engine (it is not thread-safe) and serves a bounded FIFO queue; the main
thread loads the model and handles signals. Only the standard library serves HTTP, and torch is imported only
when the model loads, so `--help` stays fast.

Endpoints: POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import logging
import math
import os
import queue
import re
import select
import signal
import socket
import socketserver
import stat
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from vismmoe_edge import sdnotify
from vismmoe_edge.errors import VismmoeError

if TYPE_CHECKING:
    from PIL import Image

    from vismmoe_edge.engine import Engine
    from vismmoe_edge.options import LoadOptions, ResolvedOptions
    from vismmoe_edge.prompt import PromptInputs

log = logging.getLogger("vismmoe_edge.server")

KiB, MiB = 1024, 1024 * 1024
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4  # as OpenAI
POLL_S = 0.1  # how often a waiting handler checks its client and deadline


# ---- limits and errors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 * MiB
    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 4096 * 4096
    max_images: int = 8
    max_prompt_tokens: int = 4096
    max_tokens: int = 512  # the cap, and the default when a request names none
    max_queue: int = 8  # requests waiting behind the one generating
    request_timeout_s: float = 300.0  # from arrival, queueing included


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3}
_SIZE_UNITS |= {"ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": 1024**3, "gib": 1024**3}


def parse_size(text: str, option: str) -> int:
    """Bytes from "20MiB", "512KB", "1048576" (config.parse_budget would import torch)."""
    m = _SIZE.match(text)
    if m is None:
        raise VismmoeError(f"{option} {text!r}: use a size like 20MiB, 512KiB or 1048576")
    value = int(float(m[1]) * _SIZE_UNITS[(m[2] or "").lower()])
    if value <= 0:
        raise VismmoeError(f"{option} {text!r} must be positive")
    return value


# ---- request parsing ----------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # the engine's content-list format, {"type": "image"} placeholders
    images: list[Image.Image]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    min_tokens: int = 0  # vLLM's extension: stop tokens are masked until this many tokens exist


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def parse_number(body: dict, name: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not (lo < value if open_lo else lo <= value) or value > hi:
        interval = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise bad_request(f"'{name}' must be a number in {interval}, got {value!r}", name)
    return float(value)


def parse_stop(value: object) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return [s for s in stops if s]


def parse_chat_request(body: object, limits: Limits, image_dir: Path | None) -> ChatRequest:
    """Validate an OpenAI chat-completions body (all but 'model') and decode its images."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if body.get("tools") or body.get("functions"):
        raise bad_request("tools and function calling are not supported", "tools")
    if body.get("logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")
    stream = body.get("stream") or False  # null means the default, as for every other field
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = parse_int(body, name, limits.max_tokens, 1, limits.max_tokens)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request(f"'seed' must be an integer, got {seed!r}", "seed")
    messages, images = parse_messages(body.get("messages"), limits, image_dir)
    return ChatRequest(
        messages=messages,
        images=images,
        max_tokens=max_tokens,
        temperature=parse_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=parse_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        seed=seed,
        stop=parse_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        min_tokens=parse_int(body, "min_tokens", 0, 0, max_tokens),
    )


def parse_messages(raw: object, limits: Limits, image_dir: Path | None) -> tuple[list[dict], list[Image.Image]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    messages: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role = "system" if message.get("role") == "developer" else message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or an array of parts", f"{where}.content")
        parts = [parse_part(p, f"{where}.content[{j}]", images, limits, image_dir) for j, p in enumerate(content)]
        messages.append({"role": role, "content": parts})
    return messages, images


def parse_part(part: object, where: str, images: list, limits: Limits, image_dir: Path | None) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise bad_request(f"{where}.image_url.url must be a string", f"{where}.image_url")
        if len(images) >= limits.max_images:
            raise bad_request(f"at most {limits.max_images} images per request", where, "too_many_images")
        images.append(load_image_url(url, f"{where}.image_url", limits, image_dir))
        return {"type": "image"}
    raise bad_request(f"{where}.type {kind!r} is not supported: use 'text' or 'image_url'", f"{where}.type")


def load_image_url(url: str, param: str, limits: Limits, image_dir: Path | None) -> Image.Image:
    """A data URL, a file:// URL or an absolute path; remote URLs are refused (a robot's daemon fetches nothing)."""
    if url.startswith("data:"):
        return decode_image(decode_data_url(url, param, limits), param, limits)
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"{param}: file URLs must be local (file:///abs/path)", param)
        path = Path(unquote(parsed.path))
    elif url.startswith("/"):
        path = Path(url)
    elif url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not fetched; send a data URL or a local path", param)
    else:
        raise bad_request(f"{param}: use a data:image/...;base64 URL, file:///abs/path or /abs/path", param)
    return decode_image(read_local_image(path, param, limits, image_dir), param, limits)


def decode_data_url(url: str, param: str, limits: Limits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise bad_request(f"{param}: image data URLs must be base64 (data:image/png;base64,...)", param)
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > limits.max_image_bytes + 2:  # reject before decoding
        raise image_too_large(param, f"more than {limits.max_image_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{param}: invalid base64 in the data URL ({e})", param) from None
    if len(data) > limits.max_image_bytes:
        raise image_too_large(param, f"{len(data)} bytes, more than {limits.max_image_bytes}")
    return data


def read_local_image(path: Path, param: str, limits: Limits, image_dir: Path | None) -> bytes:
    if not path.is_absolute():
        raise bad_request(f"{param}: local image paths must be absolute", param)
    if image_dir is not None and not path.resolve().is_relative_to(image_dir):
        raise bad_request(f"{param}: {path} is outside the served image directory {image_dir}", param)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"{param}: {path} is not a regular file", param)
        if info.st_size > limits.max_image_bytes:
            raise image_too_large(param, f"{path} has {info.st_size} bytes, more than {limits.max_image_bytes}")
        with path.open("rb") as f:
            return f.read(limits.max_image_bytes + 1)
    except OSError as e:
        raise bad_request(f"{param}: cannot read {path} ({e.strerror})", param, "image_not_found") from None


def decode_image(data: bytes, param: str, limits: Limits) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > limits.max_image_pixels:  # checked on the header, before decoding
                raise image_too_large(param, f"{img.width}x{img.height}, more than {limits.max_image_pixels} pixels")
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:
        raise bad_request(f"{param}: not an image format PIL can read (PNG, JPEG, WebP, ...)", param) from None
    except Image.DecompressionBombError as e:
        raise image_too_large(param, str(e)) from None
    except (OSError, ValueError) as e:
        raise bad_request(f"{param}: cannot decode the image ({e})", param) from None


def image_too_large(param: str, detail: str) -> ApiError:
    return bad_request(f"{param}: image too large: {detail}", param, "image_too_large")


# ---- stop strings -------------------------------------------------------------------------------------


class StopMatcher:
    """Cuts the reply at the first stop string, holding back text that may be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending = self.pending[: min(found)], ""
            return out, True
        keep = self._partial_suffix()
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        for n in range(min(len(self.pending), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


# ---- jobs ---------------------------------------------------------------------------------------------


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float]
    experts: dict[str, float]


class Job:
    """One request in flight. Events to its handler: ("started"|"delta"|"done"|"error", payload)."""

    def __init__(self, request: ChatRequest, deadline: float, on_cancel: Any) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.request = request
        self.deadline = deadline  # time.monotonic()
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.cancel_reason: str | None = None
        self._state = "queued"  # -> running -> done, or -> abandoned (never started)
        self._lock = threading.Lock()
        self._on_cancel = on_cancel

    def emit(self, kind: str, payload: Any = None) -> None:
        self.events.put((kind, payload))

    def try_start(self) -> bool:
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def finish(self) -> None:
        with self._lock:
            self._state = "done"

    def cancel(self, reason: str) -> bool:
        """Ask the worker to stop (between tokens), or drop the job if it has not started. True the first time."""
        with self._lock:
            if self.cancel_reason is not None or self._state == "done":
                return False
            self.cancel_reason = reason
            if self._state == "queued":
                self._state = "abandoned"
        self._on_cancel(reason)
        return True

    @property
    def abandoned(self) -> bool:
        return self._state == "abandoned"


# ---- metrics ------------------------------------------------------------------------------------------


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


def prometheus(samples: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]) -> str:
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


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


# ---- worker -------------------------------------------------------------------------------------------


class Heartbeat:
    """Watchdog pings, sent only by the worker as it makes progress: a stuck generation stops them."""

    def __init__(self, interval_s: float | None) -> None:
        self.interval_s = interval_s
        self.min_gap_s = interval_s / 4 if interval_s else 0.0
        self.last = 0.0

    def beat(self) -> None:
        if self.interval_s is None:
            return
        now = time.monotonic()
        if now - self.last >= self.min_gap_s:
            self.last = now
            sdnotify.watchdog()


def install_progress_pings(engine: Any, heartbeat: Heartbeat) -> None:
    """Ping (rate-limited) as each decoder layer and vision block returns, so a long prefill counts as progress
    while a hung kernel or read does not: a forward hook runs only once its layer has finished."""
    inner = getattr(getattr(engine, "model", None), "model", None)
    modules = list(getattr(getattr(inner, "language_model", None), "layers", None) or [])
    modules += list(getattr(getattr(inner, "visual", None), "blocks", None) or [])
    for module in modules:
        module.register_forward_hook(lambda *_: heartbeat.beat())


class Worker:
    """The only thread that touches the Engine: takes jobs in FIFO order and generates their replies."""

    def __init__(self, engine: Engine, limits: Limits, metrics: Metrics) -> None:
        self.engine = engine
        self.limits = limits
        self.metrics = metrics
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=limits.max_queue)
        self.heartbeat = Heartbeat(sdnotify.watchdog_interval())
        if self.heartbeat.interval_s is not None:
            install_progress_pings(engine, self.heartbeat)
        self.tick_s = min(0.5, self.heartbeat.interval_s / 2) if self.heartbeat.interval_s else 0.5
        self.max_positions = int(getattr(engine.text_config, "max_position_embeddings", 0) or 0)
        self.pending = 0  # queued + running: drained when 0
        self.pending_lock = threading.Lock()
        self.running: Job | None = None
        self.cancel_all = threading.Event()  # shutdown: in-flight work stops at the next token
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="vismmoe-worker", daemon=True)

    # -- queue side (handler threads) --
    def submit(self, job: Job) -> None:
        with self.pending_lock:
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                retry = max(1, min(60, math.ceil(self.metrics.mean_request_s * (self.jobs.qsize() + 1))))
                raise ApiError(
                    429,
                    f"the request queue is full ({self.limits.max_queue} waiting); retry later",
                    type="rate_limit_exceeded",
                    code="queue_full",
                    headers={"Retry-After": str(retry)},
                ) from None
            self.pending += 1
        self.update_status()

    def idle(self) -> bool:
        return self.pending == 0

    def abort_queued(self) -> None:
        """Shutdown: answer every job still waiting with 503."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job.cancel("shutdown"):
                job.emit("error", shutdown_error())
            self.job_finished()

    # -- worker thread --
    def loop(self) -> None:
        while not self.stop.is_set():
            self.heartbeat.beat()  # idle but healthy: the loop itself still turns
            try:
                job = self.jobs.get(timeout=self.tick_s)
            except queue.Empty:
                continue
            try:
                self.process(job)
            finally:
                self.job_finished()

    def job_finished(self) -> None:
        with self.pending_lock:
            self.pending -= 1
        self.update_status()

    def process(self, job: Job) -> None:
        if not job.try_start():
            return  # abandoned while queued: its handler already answered
        self.running = job
        start = time.monotonic()
        try:
            if self.cancel_all.is_set():
                job.cancel("shutdown")
                raise shutdown_error()
            if start > job.deadline:
                job.cancel("deadline")
                raise timeout_error()
            inputs = self.encode(job.request)
            job.emit("started")
            completion = self.generate(job, inputs)
            self.metrics.record_generation(completion, time.monotonic() - start)
            if job.cancel_reason is not None:
                log.info("%s: cancelled (%s) after %d tokens", job.id, job.cancel_reason, completion.completion_tokens)
            job.emit("done", completion)
        except ApiError as e:
            job.emit("error", e)
        except Exception as e:  # a bug or a device failure: answer 500 and keep serving
            log.exception("request %s failed", job.id)
            job.emit("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        finally:
            job.finish()  # a client leaving after this point cancels nothing
            self.running = None

    def encode(self, request: ChatRequest) -> PromptInputs:
        try:
            inputs = self.engine.encode_messages(request.messages, request.images)
        except (VismmoeError, ValueError) as e:
            raise bad_request(f"cannot build the prompt: {e}", "messages") from None
        n = inputs.num_tokens
        if n > self.limits.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {n} tokens, more than the limit of {self.limits.max_prompt_tokens}",
                "messages",
                "context_length_exceeded",
            )
        if self.max_positions and n + request.max_tokens > self.max_positions:
            raise bad_request(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the model's "
                f"{self.max_positions} positions",
                "max_tokens",
                "context_length_exceeded",
            )
        return inputs

    def should_stop(self, job: Job) -> bool:
        """Polled by the engine between tokens, so it also carries the watchdog ping of a healthy decode."""
        self.heartbeat.beat()
        if self.cancel_all.is_set():
            job.cancel("shutdown")
        elif time.monotonic() > job.deadline:
            job.cancel("deadline")
        return job.cancel_reason is not None

    def generate(self, job: Job, inputs: PromptInputs) -> Completion:
        from vismmoe_edge.detokenize import TextStream
        from vismmoe_edge.engine import Timings
        from vismmoe_edge.sampling import SamplingConfig

        req = job.request
        sampling = SamplingConfig(
            max_new_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            min_new_tokens=req.min_tokens,
        )
        stop_ids = set(self.engine.eos_token_ids)
        detok = TextStream(self.engine.processor.tokenizer)
        stops = StopMatcher(req.stop)
        timings = Timings()
        text: list[str] = []
        produced, finish, hit = 0, None, False
        self.metrics.absorb_expert_stats(self.engine.experts.pipeline)  # what prefetch did while idle
        stream = self.engine.stream(inputs, sampling, timings=timings, should_stop=lambda: self.should_stop(job))
        with contextlib.closing(stream):
            for token in stream:
                produced += 1
                if token in stop_ids:
                    finish = "stop"
                    break
                piece, hit = stops.push(detok.push(token))
                self.emit_text(job, piece, text)
                if hit:
                    break
        if not hit:  # flush what was held back: half a character, or the start of a stop string
            piece, hit = stops.push(detok.finish())
            self.emit_text(job, piece if hit else piece + stops.flush(), text)
        experts = self.metrics.absorb_expert_stats(self.engine.experts.pipeline)
        if hit:
            finish = "stop"
        elif finish is None:
            finish = self.finish_reason(job, produced)
        return Completion("".join(text), finish, inputs.num_tokens, produced, timings.as_dict(), experts)

    def emit_text(self, job: Job, piece: str, text: list[str]) -> None:
        if piece:
            text.append(piece)
            if job.request.stream:
                job.emit("delta", piece)

    def finish_reason(self, job: Job, produced: int) -> str:
        """Out of tokens, or cut short: a deadline or a shutdown returns what exists as "length"."""
        if job.cancel_reason in ("deadline", "shutdown") and produced == 0:
            raise timeout_error() if job.cancel_reason == "deadline" else shutdown_error()
        return "length"

    def update_status(self) -> None:
        with self.metrics.lock:
            tps, done = self.metrics.last_decode_tps, self.metrics.completed
        sdnotify.status(f"serving {self.pending} requests, {tps:.1f} tok/s, {done} done")


def timeout_error() -> ApiError:
    return ApiError(504, "the request timed out before any token was produced", type="timeout", code="timeout")


def shutdown_error() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutdown")


# ---- the service: state shared by the handlers ---------------------------------------------------------


@dataclass
class ServeOptions:
    model: Path | None = None
    model_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    unix_socket: Path | None = None
    memory_budget: str = "auto"  # auto, and pinned_layers None, and tier auto: the planner's
    pinned_layers: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    tier: str = "auto"
    predictor: str = "auto"
    policy: str = "lru"
    compression: Any = None  # a CompressionConfig (imported lazily: `serve --help` must not load torch)
    profile: str = "auto"
    image_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    drain_timeout_s: float = 30.0
    load_timeout_s: float = 600.0


class Service:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.limits = options.limits
        self.image_dir = options.image_dir.resolve() if options.image_dir else None
        self.metrics = Metrics()
        self.state = "loading"  # -> ok -> draining; "stopped" if loading failed
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.model_id = options.model_id or ""
        self.started = time.time()
        self.profile_name: str | None = None  # the planner's choice, when it was asked
        self.settings: dict[str, Any] = {}  # what the engine was loaded with
        self.handlers = 0  # chat-completion handlers still answering: drained before exit
        self.handlers_lock = threading.Lock()

    # -- lifecycle (main thread) --
    def load(self) -> None:
        from vismmoe_edge.checkpoint_info import inspect_checkpoint
        from vismmoe_edge.options import load_resolved

        o = self.options
        checkpoint = inspect_checkpoint(o.model)
        resolved = self.resolve(checkpoint, replan=False)
        self.engine = load_resolved(checkpoint, self.load_options(), resolved)
        self.model_id = o.model_id or self.engine.model_dir.name
        self.worker = Worker(self.engine, self.limits, self.metrics)
        self.worker.thread.start()
        self.state = "ok"

    def load_options(self) -> LoadOptions:
        from vismmoe_edge.options import LoadOptions

        o = self.options
        return LoadOptions(
            memory_budget=o.memory_budget,
            pinned_layers=o.pinned_layers,
            tier=o.tier,
            device=o.device,
            dtype=o.dtype,
            predictor=o.predictor,
            policy=o.policy,
            profile=o.profile,
            compression=o.compression,
        )

    def resolve(self, checkpoint: Any, replan: bool) -> ResolvedOptions:
        """The options with the planner's choices filled in, as `vismmoe-edge run` resolves them. On a re-plan
        the planner must not count our own memory."""
        from vismmoe_edge.options import resolve

        measured = self.memory_without_us() if replan else {}
        resolved = resolve(self.load_options(), checkpoint, **measured)
        if resolved.plan is not None:
            self.profile_name = resolved.plan.profile
            for warning in resolved.plan.warnings:
                log.warning("plan: %s", warning)
            log.info("%s", resolved.note)
        self.settings = {
            "memory_budget": resolved.memory_budget,
            "pinned_layers": resolved.pinned_layers,
            "tier": resolved.tier,
            "prefetch_depth": resolved.prefetch_depth,
        }
        return resolved

    def memory_without_us(self) -> dict[str, int]:
        """What the planner would measure were this process not loaded: MemAvailable plus our anonymous memory,
        free GPU memory plus what torch holds. Page-cache and mlocked pages are not corrected for."""
        out: dict[str, int] = {}
        if available := mem_available_bytes():
            out["mem_available"] = available + rss_anon_bytes()
        if self.engine is not None and self.engine.device.type == "cuda":
            import torch

            free, _total = torch.cuda.mem_get_info(self.engine.device)
            out["gpu_free"] = int(free) + int(torch.cuda.memory_reserved(self.engine.device))
        return out

    def reload_profile(self) -> None:
        """The SIGHUP hook: re-plan from --profile (auto follows a power-mode change) and compare with what is
        loaded. Applying a different plan needs the engine rebuilt, which this does not do yet: it says so."""
        from vismmoe_edge.checkpoint_info import inspect_checkpoint

        loaded = dict(self.settings)
        try:
            self.resolve(inspect_checkpoint(self.options.model), replan=True)
        except VismmoeError as e:
            log.error("SIGHUP: cannot re-plan (%s); keeping the current settings", e)
            return
        settings, self.settings = self.settings, loaded
        changed = {k: (loaded[k], v) for k, v in settings.items() if str(v) != str(loaded[k])}
        if changed:
            text = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
            log.warning("profile reloaded: the new plan differs (%s); restart the service to apply it", text)
        else:
            log.info("profile reloaded: the plan is unchanged")
        with self.metrics.lock:
            self.metrics.reloads += 1
            self.metrics.plan_differs = bool(changed)

    def drain(self) -> None:
        """Refuse new work, let in-flight work finish for drain_timeout_s, then cancel what is left."""
        self.state = "draining"
        worker = self.worker
        if worker is None:
            return
        deadline = time.monotonic() + self.options.drain_timeout_s
        while not worker.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not worker.idle():
            log.warning("drain timeout (%.0f s): cancelling %d requests", self.options.drain_timeout_s, worker.pending)
            worker.cancel_all.set()
            worker.abort_queued()
        worker.stop.set()
        worker.thread.join(timeout=10)  # one token, or a prefill, cannot be interrupted
        if worker.thread.is_alive():
            log.error("the worker did not stop within 10 s (stuck in a prefill?): exiting anyway")
        end = time.monotonic() + 2  # let handlers write their final bytes
        while self.handlers and time.monotonic() < end:
            time.sleep(0.02)

    # -- request side (handler threads) --
    def submit(self, request: ChatRequest, arrival: float) -> Job:
        worker = self.worker
        if self.state != "ok" or worker is None:
            raise unavailable(self.state)
        job = Job(request, arrival + self.limits.request_timeout_s, self.metrics.record_cancel)
        worker.submit(job)
        return job

    def check_model(self, model: object) -> None:
        if model is not None and model != self.model_id:
            raise ApiError(
                404,
                f"the model {model!r} is not served here; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def health(self) -> dict[str, Any]:
        worker = self.worker
        return {
            "status": self.state,
            "model": self.model_id or None,
            "profile": self.profile_name,
            "queue_depth": worker.jobs.qsize() if worker else 0,
            "in_flight": 1 if worker and worker.running else 0,
            "uptime_s": round(time.time() - self.started, 3),
        }

    def models(self) -> list[dict[str, Any]]:
        if not self.model_id or self.state == "loading":
            return []
        return [{"id": self.model_id, "object": "model", "created": int(self.started), "owned_by": "vismmoe-edge"}]

    def render_metrics(self) -> str:
        m, worker = self.metrics, self.worker
        pipeline = self.engine.experts.pipeline if self.engine is not None else None
        with m.lock:
            live = pipeline.stats if pipeline is not None else None
            hits = m.expert["hits"] + (live.hits if live else 0)
            misses = m.expert["misses"] + (live.misses if live else 0)
            bytes_read = m.expert["bytes_read"] + (live.bytes_read if live else 0)
            stall = m.expert["stall_s"] + (live.stall_s if live else 0.0)
            samples = [
                (
                    "vismmoe_up",
                    "gauge",
                    "1 once the model is loaded and requests are accepted",
                    [({}, 1.0 if self.state == "ok" else 0.0)],
                ),
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
                (
                    "vismmoe_decode_tokens_per_second",
                    "gauge",
                    "decode speed of the last request",
                    [({}, m.last_decode_tps)],
                ),
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
                (
                    "vismmoe_expert_stall_seconds_total",
                    "counter",
                    "compute time spent waiting for experts",
                    [({}, stall)],
                ),
                (
                    "vismmoe_expert_resident_bytes",
                    "gauge",
                    "expert bytes resident now",
                    [({}, live.resident_bytes if live else 0)],
                ),
                (
                    "vismmoe_queue_depth",
                    "gauge",
                    "requests waiting for the worker",
                    [({}, worker.jobs.qsize() if worker else 0)],
                ),
                ("vismmoe_queue_capacity", "gauge", "--max-queue", [({}, self.limits.max_queue)]),
                (
                    "vismmoe_requests_in_flight",
                    "gauge",
                    "requests generating now",
                    [({}, 1 if worker and worker.running else 0)],
                ),
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
            ("vismmoe_memory_available_bytes", "gauge", "MemAvailable of the host", [({}, mem_available_bytes())]),
            ("process_start_time_seconds", "gauge", "start time since the epoch", [({}, self.started)]),
        ]
        return prometheus(samples)


def unavailable(state: str) -> ApiError:
    message = "the model is still loading" if state == "loading" else "the server is shutting down"
    return ApiError(503, message, type="server_error", code=state, headers={"Retry-After": "5"})


# ---- HTTP ---------------------------------------------------------------------------------------------


def chunk(job: Job, service: Service, delta: dict, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": job.id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": service.model_id,
        "system_fingerprint": None,
        "choices": [choice],
    }


def usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


def completion_body(job: Job, service: Service, c: Completion) -> dict[str, Any]:
    message = {"role": "assistant", "content": c.text, "refusal": None}
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": service.model_id,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": c.finish_reason}],
        "usage": usage(c),
        "vismmoe": {"timings": c.timings, "experts": c.experts},  # extra fields: clients ignore them
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for JSON answers; SSE answers close the connection
    server_version = "vismmoe-edge"
    timeout = 120  # an idle keep-alive connection or a stalled client frees its thread after this
    server: ServerMixin

    @property
    def service(self) -> Service:
        return self.server.service

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def address_string(self) -> str:
        return str(self.client_address[0]) if self.client_address else "unix"

    # -- routing --
    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/health":
            self.send_json(200, self.service.health())
        elif path == "/metrics":
            self.send_bytes(200, self.service.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": self.service.models()})
        elif path.startswith("/v1/models/"):
            wanted = unquote(path.removeprefix("/v1/models/"))
            found = [m for m in self.service.models() if m["id"] == wanted]
            if found:
                self.send_json(200, found[0])
            else:
                self.send_error_json(ApiError(404, f"the model {wanted!r} does not exist", code="model_not_found"))
        else:
            self.send_error_json(ApiError(404, f"no route GET {path}", code="not_found"))

    def do_POST(self) -> None:
        path = urlparse(self.path).path
        if path != "/v1/chat/completions":
            self.send_error_json(ApiError(404, f"no route POST {path}", code="not_found"))
            return
        with self.server.service.handlers_lock:
            self.service.handlers += 1
        try:
            self.chat_completions()
        finally:
            with self.service.handlers_lock:
                self.service.handlers -= 1

    # -- responses --
    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True  # the client left; nothing to tell it

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

    def send_error_json(self, error: ApiError) -> None:
        self.send_json(error.status, error.body(), error.headers)

    # -- chat completions --
    def chat_completions(self) -> None:
        self.close_connection = True  # until the body is read: unread bytes must not pass for the next request
        try:
            if self.service.state != "ok":
                raise unavailable(self.service.state)
            body = self.read_json_body()
            arrival = time.monotonic()
            self.service.check_model(body.get("model") if isinstance(body, dict) else None)
            request = parse_chat_request(body, self.service.limits, self.service.image_dir)
            job = self.service.submit(request, arrival)
        except ApiError as e:
            self.refuse(e)
            return
        if request.stream:
            self.answer_stream(job)
        else:
            self.answer_blocking(job)

    def refuse(self, error: ApiError) -> None:
        self.service.metrics.record_response(error.status)
        log.info("chat completion refused: %d %s", error.status, error.message)
        self.send_error_json(error)

    def read_json_body(self) -> object:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise ApiError(411, "chunked request bodies are not supported; send Content-Length", code="length_required")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header is required", code="length_required") from None
        if length > self.service.limits.max_body_bytes:
            raise ApiError(
                413,
                f"the request body has {length} bytes, more than the limit of {self.service.limits.max_body_bytes}",
                code="request_too_large",
            )
        data = self.rfile.read(length)
        if len(data) < length:
            raise bad_request("the request body ended early")
        self.close_connection = False
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None

    def client_gone(self) -> bool:
        """The peer closed its end: readable with nothing to read (poll: select() fails above fd 1023)."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
            events = poller.poll(0)
            if not events:
                return False
            if events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                return True
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def next_event(self, job: Job) -> tuple[str, Any] | None:
        """The job's next event; None if the client left (the job is then cancelled)."""
        while True:
            try:
                return job.events.get(timeout=POLL_S)
            except queue.Empty:
                pass
            if self.client_gone():
                job.cancel("client_disconnect")
                return None
            if time.monotonic() > job.deadline and job.cancel("deadline") and job.abandoned:
                return ("error", timeout_error())  # still queued: answer now, the worker will skip it

    def answer_blocking(self, job: Job) -> None:
        while True:
            event = self.next_event(job)
            if event is None:
                self.service.metrics.record_response(499)
                self.close_connection = True
                return
            kind, payload = event
            if kind == "error":
                self.refuse(payload)
                return
            if kind == "done":
                self.service.metrics.record_response(200)
                self.send_json(200, completion_body(job, self.service, payload))
                self.log_done(job, payload)
                return

    def answer_stream(self, job: Job) -> None:
        event = self.next_event(job)
        if event is None:
            self.service.metrics.record_response(499)
            self.close_connection = True
            return
        if event[0] == "error":
            self.refuse(event[1])
            return
        self.close_connection = True  # no Content-Length: the end of the body is the end of the connection
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.send_header("X-Accel-Buffering", "no")
            self.end_headers()
            self.service.metrics.record_response(200)
            self.send_event(chunk(job, self.service, {"role": "assistant", "content": ""}, None))
            self.relay(job, event)
        except OSError:  # BrokenPipeError, ConnectionResetError: the client left mid-stream
            job.cancel("client_disconnect")

    def relay(self, job: Job, event: tuple[str, Any] | None) -> None:
        while event is not None:
            kind, payload = event
            if kind == "delta":
                self.send_event(chunk(job, self.service, {"content": payload}, None))
            elif kind == "done":
                self.send_event(chunk(job, self.service, {}, payload.finish_reason))
                if job.request.include_usage:
                    self.send_event({**chunk(job, self.service, {}, None), "choices": [], "usage": usage(payload)})
                self.send_sse("[DONE]")
                self.log_done(job, payload)
                return
            elif kind == "error":
                self.send_event(payload.body())
                self.send_sse("[DONE]")
                return
            event = self.next_event(job)

    def send_event(self, obj: dict[str, Any]) -> None:
        self.send_sse(json.dumps(obj))

    def send_sse(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())

    def log_done(self, job: Job, c: Completion) -> None:
        log.info(
            "%s: %d prompt + %d completion tokens, finish %s, %.1f tok/s",
            job.id,
            c.prompt_tokens,
            c.completion_tokens,
            c.finish_reason,
            c.timings.get("decode_tokens_per_s", 0.0),
        )


class ServerMixin:
    service: Service
    request_queue_size = 64  # listen backlog: a burst of clients gets queued or a 429, not a refused connection


class TCPServer(ServerMixin, ThreadingHTTPServer):
    def __init__(self, host: str, port: int, service: Service) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.service = service
        super().__init__((host, port), Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would do a reverse DNS lookup of the host
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def url(self) -> str:
        host = self.server_name
        return f"http://[{host}]:{self.server_port}" if ":" in host else f"http://{host}:{self.server_port}"


class UnixServer(ServerMixin, ThreadingHTTPServer):
    address_family = socket.AF_UNIX

    def __init__(self, path: Path, service: Service) -> None:
        self.service = service
        self.path = path
        super().__init__(str(path), Handler)

    def server_bind(self) -> None:
        remove_stale_socket(self.path)
        socketserver.TCPServer.server_bind(self)
        self.bound = True  # from now on the socket file is ours to remove
        self.server_name, self.server_port = "localhost", 0

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)  # handlers expect an (address, port) pair

    def server_close(self) -> None:
        super().server_close()
        if getattr(self, "bound", False):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def url(self) -> str:
        return f"unix:{self.path}"


def remove_stale_socket(path: Path) -> None:
    """A socket file left by a crashed run blocks bind(); remove it unless a live server still answers there."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise VismmoeError(f"--unix-socket {path}: exists and is not a socket; remove it or pick another path")
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
            return
    raise VismmoeError(f"--unix-socket {path}: another server is listening there")


def parse_listen(text: str) -> tuple[str, int, Path | None]:
    """--listen unix:PATH | HOST:PORT | [V6]:PORT -> (host, port, unix socket path)."""
    if text.startswith("unix:"):
        return "127.0.0.1", 0, Path(text.removeprefix("unix:"))
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or not host or int(port) > 65535:
        raise VismmoeError(f"--listen {text!r}: use unix:PATH or HOST:PORT (127.0.0.1:8080, [::1]:8080)")
    return host.removeprefix("[").removesuffix("]"), int(port), None


def make_server(options: ServeOptions, service: Service) -> TCPServer | UnixServer:
    try:
        if options.unix_socket is not None:
            return UnixServer(options.unix_socket, service)
        return TCPServer(options.host, options.port, service)
    except OSError as e:
        where = options.unix_socket or f"{options.host}:{options.port}"
        raise VismmoeError(f"cannot listen on {where}: {e.strerror or e}") from None


# ---- main ---------------------------------------------------------------------------------------------


class Terminate(BaseException):
    """Raised by SIGTERM while the model loads: a load cannot be drained, only abandoned."""


class Signals:
    """Signal handlers only set flags: the main loop acts on them (no locks taken inside a handler)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.terminate = False
        self.reload = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_terminate)
        signal.signal(signal.SIGINT, self.on_terminate)
        signal.signal(signal.SIGHUP, self.on_hangup)

    def on_terminate(self, signum: int, frame: object) -> None:
        worker = self.service.worker
        if self.terminate and worker is not None:
            worker.cancel_all.set()  # a second SIGTERM/SIGINT: cancel now instead of after --drain-timeout
        self.terminate = True
        if self.service.state == "loading":
            raise Terminate()

    def on_hangup(self, signum: int, frame: object) -> None:
        self.reload = True


def serve(options: ServeOptions) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status (2: a configuration error)."""
    service = Service(options)
    signals = Signals(service)
    signals.install()  # first: a SIGTERM during start-up must still exit 0
    httpd: TCPServer | UnixServer | None = None
    try:
        httpd = start_http(options, service)
        sdnotify.extend_timeout(int(options.load_timeout_s * 1e6))
        sdnotify.status("loading the model")
        service.load()
    except Terminate:
        service.state = "stopped"  # a second signal must not raise Terminate again
        log.info("terminated while loading")
        sdnotify.stopping()
        stop_http(httpd)
        return 0
    except VismmoeError as e:  # a bad model path, option, profile or address: restarting cannot fix it
        service.state = "stopped"
        log.error("cannot start: %s", e)
        sdnotify.status(f"failed: {e}")
        stop_http(httpd)
        return 2
    sdnotify.ready(f"serving 0 requests, model {service.model_id}")
    log.info("ready: model %s on %s", service.model_id, httpd.url())
    return main_loop(service, httpd, signals)


def start_http(options: ServeOptions, service: Service) -> TCPServer | UnixServer:
    """Listen before loading: /health answers "loading", and a taken port fails before a long load."""
    httpd = make_server(options, service)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True).start()
    if options.unix_socket is None and options.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("listening on %s without authentication: anyone who can reach it can use the model", options.host)
    log.info("listening on %s; loading the model", httpd.url())
    return httpd


def stop_http(httpd: TCPServer | UnixServer | None) -> None:
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()


def main_loop(service: Service, httpd: TCPServer | UnixServer, signals: Signals) -> int:
    while not signals.terminate:
        time.sleep(0.1)
        if signals.reload:
            signals.reload = False
            sdnotify.reloading()
            service.reload_profile()
            sdnotify.ready("reloaded the profile")
            if service.worker is not None:
                service.worker.update_status()
    log.info("stopping: draining for up to %.0f s", service.options.drain_timeout_s)
    sdnotify.stopping()
    sdnotify.status("draining")
    service.drain()
    stop_http(httpd)
    log.info("stopped")
    return 0
