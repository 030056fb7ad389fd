"""`vismmoe-edge serve`: a daemon holding one loaded model behind an OpenAI-compatible HTTP API.

Threads: the HTTP server's handler threads parse, validate and enqueue requests, then wait for or relay their
results (serve/http.py); one worker thread owns the Engine (it is not thread-safe) and serves a bounded FIFO
queue (serve/worker.py); the main thread loads the model and handles signals (here). Only the standard library
serves HTTP, and torch is imported only when the model loads, so `--help` stays fast.

Endpoints: POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve import metrics as metrics_text
from vismmoe_edge.serve import sdnotify
from vismmoe_edge.serve.admission import client_key
from vismmoe_edge.serve.bodies import ByteBudget
from vismmoe_edge.serve.bounded_json import JsonLimits, check_json_bounds
from vismmoe_edge.serve.images import load_image_url
from vismmoe_edge.serve.metrics import Metrics, host_mem_available, rss_anon_bytes
from vismmoe_edge.serve.policy import HttpPolicy
from vismmoe_edge.serve.protocol import (
    ApiError,
    ChatRequest,
    Limits,
    bad_request,
    parse_chat_request,
    prompt_text_bytes,
    unavailable,
)
from vismmoe_edge.serve.servers import TCPServer, UnixServer, make_server
from vismmoe_edge.serve.videos import VideoReader, check_request_media
from vismmoe_edge.serve.warmup import warm_decoder, warm_suffix_graphs
from vismmoe_edge.serve.worker import Job, Worker, use_mmap_for_large_allocations

if TYPE_CHECKING:
    from vismmoe_edge.engine import Engine
    from vismmoe_edge.options import LoadOptions, ResolvedOptions

log = logging.getLogger("vismmoe_edge.serve")


def _load_options() -> LoadOptions:
    from vismmoe_edge.options import LoadOptions

    return LoadOptions()


@dataclass
class ServeOptions:
    model: Path | None = None
    model_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    unix_socket: Path | None = None
    socket_mode: int = 0o660  # the Unix socket's permissions, set by the daemon (not left to the umask)
    load: LoadOptions = field(default_factory=_load_options)  # what `run` takes; "auto": the planner's
    image_dirs: tuple[Path, ...] = ()  # local image paths are served from these only; none: local paths are off
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS); none by default
    api_key: str | None = None  # bearer token required on /v1/ when set
    limits: Limits = field(default_factory=Limits)
    drain_timeout_s: float = 30.0
    load_timeout_s: float = 600.0


class Service:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.limits = options.limits
        self.image_dirs = resolve_image_dirs(options.image_dirs)
        self.policy = HttpPolicy.for_listener(
            options.host, options.unix_socket, options.allowed_origins, options.api_key
        )
        self.bodies = ByteBudget(options.limits.max_pending_bytes)
        self.estimate_tokens: Any = None  # (width, height) -> visual tokens, from the processor once loaded
        self.video_processor: Any = None  # the model's, frames capped at --video-max-pixels; None: no video
        self.vocab_size = 0
        self.max_positions = 0
        self.max_token_bytes = DEFAULT_MAX_TOKEN_BYTES  # the tokenizer's longest token, once loaded
        self.json_limits = JsonLimits.for_chat(self.limits, self.max_text_bytes())
        self.metrics = Metrics()
        self.state = "loading"  # -> ok -> draining; "stopped" if loading failed
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.model_id = options.model_id or ""
        self.started = time.time()
        self.profile_name: str | None = None  # the planner's choice, when it was asked
        self.settings: dict[str, Any] = {}  # what the engine was loaded with
        self.listener: TCPServer | UnixServer | None = None  # for /metrics' connection counts
        self.handlers = 0  # chat-completion handlers still answering: drained before exit
        self.handlers_lock = threading.Lock()
        self.grammar_lock = threading.Lock()

    # -- lifecycle (main thread) --
    def load(self) -> None:
        import torch

        from vismmoe_edge.checkpoint_info import inspect_checkpoint
        from vismmoe_edge.options import load_resolved

        # The worker thread computes; this one only loads. A thread that has run one parallel op keeps an OpenMP
        # team of its own, and beside it the worker's parallel ops ran 1.6-2x slower on a 2-core machine (the
        # demo model's prefill: docs/serving.md, "CPU threads"). So the load runs on one thread here, and the
        # worker takes torch's default count.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        o = self.options
        checkpoint = inspect_checkpoint(o.model)
        resolved = self.resolve(checkpoint, replan=False)
        self.engine = load_resolved(checkpoint, self.load_options(), resolved)
        self.model_id = o.model_id or self.engine.model_dir.name
        self.worker = Worker(self.engine, self.limits, self.metrics, threads=threads)
        self.worker.thread.start()  # no job comes before READY; the warm-ups below run on it
        sdnotify.status("compiling the decoder")
        longest = self.limits.max_prompt_tokens + self.limits.max_tokens
        # compiled on the thread that will serve, with its thread state, which torch.compile's guards check
        if (seconds := self.worker.call(warm_decoder, self.engine, longest)) is not None:
            log.info("decoder ready for %d positions in %.1f s (serve/warmup.py)", longest, seconds)
        if (seconds := self.worker.call(warm_suffix_graphs, self.engine)) is not None:
            log.info("the question after a cached frame compiled in %.1f s (serve/warmup.py)", seconds)
        self.estimate_tokens = visual_token_estimator(self.engine.processor)
        self.video_processor = video_processor_for(self.engine.processor, self.limits.video_max_pixels)
        text_config = self.engine.text_config
        self.vocab_size = int(getattr(text_config, "vocab_size", 0) or len(self.engine.processor.tokenizer))
        self.max_positions = self.worker.max_positions
        self.max_token_bytes = longest_token_bytes(self.engine.processor.tokenizer)
        self.json_limits = JsonLimits.for_chat(self.limits, self.max_text_bytes())
        log.info(
            "prompts of more than %d bytes of text are refused before tokenizing (%d tokens of at most %d bytes)",
            self.max_text_bytes(),
            self.limits.max_prompt_tokens,
            self.max_token_bytes,
        )
        self.state = "ok"

    def load_options(self) -> LoadOptions:
        return self.options.load

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
            "memory_budget": resolved.memory_budget_bytes,
            "pinned_layers": resolved.pinned_layers,
            "tier": resolved.tier,
            "prefetch_depth": resolved.prefetch_depth,
        }
        return resolved

    def memory_without_us(self) -> dict[str, int]:
        """What the planner would measure were this process not loaded: MemAvailable plus our anonymous memory,
        free GPU memory plus what torch holds. Page-cache and mlocked pages are not corrected for."""
        out: dict[str, int] = {}
        if available := host_mem_available():
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
    def start_chat(self, data: bytes, peer: str) -> Job:
        """Parse, check every budget that can be checked from headers, and queue; any refusal is an ApiError."""
        arrival = time.monotonic()
        worker = self.worker
        if self.state != "ok" or worker is None:
            raise unavailable(self.state)
        request = self.parse(data)
        job = Job(request, arrival + self.limits.request_timeout_s, self.metrics.record_cancel)
        worker.submit(job, client_key(peer, data))
        return job

    def max_text_bytes(self) -> int:
        """A prompt's text beyond this many UTF-8 bytes has more than --max-prompt-tokens tokens: each token
        stands for at most max_token_bytes bytes of text."""
        return self.limits.max_prompt_tokens * self.max_token_bytes

    def parse(self, data: bytes) -> ChatRequest:
        check_json_bounds(data, self.json_limits)  # before json.loads builds anything
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON ({str(e)[:200]})", code="invalid_json") from None
        except RecursionError:
            raise bad_request("the request body nests too deeply", code="invalid_json") from None
        self.check_model(body.get("model") if isinstance(body, dict) else None)
        dirs, limits, estimate = self.image_dirs, self.limits, self.estimate_tokens

        def load_image(url: str, param: str) -> Any:
            return load_image_url(url, param, limits, dirs, estimate)

        videos = VideoReader(limits, dirs, self.video_processor, load_image)
        request = parse_chat_request(body, limits, load_image, self.vocab_size, videos)
        text_bytes = prompt_text_bytes(request.messages)
        if text_bytes > self.max_text_bytes():  # refused from its bytes: tokenizing it would cost seconds and GiB
            raise bad_request(
                f"the prompt has {text_bytes} bytes of text, more than {self.limits.max_prompt_tokens} tokens can "
                f"hold (a token of this tokenizer is at most {self.max_token_bytes} bytes)",
                "messages",
                "context_length_exceeded",
            )
        check_request_media(request.images, request.videos, limits, request.max_tokens, self.max_positions)
        if request.response_format is not None and self.worker is not None:
            with self.grammar_lock:  # built once, on the first request that asks for one
                grammars = self.worker.json_grammars()
            request.response_format["grammar"] = grammars.compile(request.response_format)
        return request

    def check_model(self, model: object) -> None:
        if model is not None and model != self.model_id:
            raise ApiError(
                404,
                f"the model {str(model)[:100]!r} is not served here; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def health(self) -> dict[str, Any]:
        """ "ok" only when requests are served (HTTP 200); "loading" and "draining" answer 503, as llama-server."""
        worker = self.worker
        return {
            "status": self.state,
            "model": self.model_id or None,
            "profile": self.profile_name,
            "queue_depth": worker.queue_depth() if worker else 0,
            "in_flight": 1 if worker and worker.running else 0,
            "uptime_s": round(time.time() - self.started, 3),
        }

    def models(self) -> list[dict[str, Any]]:
        if not self.model_id or self.state == "loading":
            return []
        card = {"id": self.model_id, "object": "model", "created": int(self.started), "owned_by": "vismmoe-edge"}
        # Not in OpenAI's schema (clients ignore extra fields): what the model takes, as vLLM and Ollama say it.
        modalities = ["text", "image"] + (["video"] if self.video_processor is not None else [])
        card |= {"input_modalities": modalities, "capabilities": ["completion", "vision", "json_schema"]}
        card |= {"max_model_len": self.max_positions or None}
        return [card]

    def render_metrics(self) -> str:
        worker = self.worker
        return metrics_text.render(
            self.metrics,
            up=self.state == "ok",
            live=self.engine.experts.pipeline.stats if self.engine is not None else None,
            queue_depth=worker.queue_depth() if worker else 0,
            queue_capacity=self.limits.max_queue,
            in_flight=1 if worker and worker.running else 0,
            started=self.started,
            extra=[
                ("vismmoe_pending_request_bytes", "gauge", "request bytes held now", [({}, self.bodies.used)]),
                ("vismmoe_pending_request_bytes_limit", "gauge", "--max-pending-bytes", [({}, self.bodies.capacity)]),
                (
                    "vismmoe_queue_places_held",
                    "gauge",
                    "refused clients whose place in line is kept for their retry",
                    [({}, worker.admission.held if worker else 0)],
                ),
                *metrics_text.prefix_cache_samples(self.engine.prefix_cache if self.engine is not None else None),
                *(self.listener.connection_samples() if self.listener is not None else []),
            ],
        )


DEFAULT_MAX_TOKEN_BYTES = 256  # before the tokenizer is loaded (no request is served then)


def longest_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any vocabulary entry (special tokens included) can stand for. The entries' own text
    is an upper bound: byte-level BPE writes each byte as one character of at most 2 UTF-8 bytes, SentencePiece
    writes a space as the 3-byte '▁' and a byte-fallback token as '<0xAB>'."""
    vocab = tokenizer.get_vocab()
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=DEFAULT_MAX_TOKEN_BYTES)


def resolve_image_dirs(dirs: tuple[Path, ...]) -> tuple[str, ...]:
    """--image-dir values as resolved absolute paths; each must be an existing directory."""
    resolved = []
    for d in dirs:
        if str(d) == "":
            continue  # the unit passes ${VISMMOE_EDGE_IMAGE_DIR} even when it is empty
        real = os.path.realpath(d)
        if not os.path.isdir(real):
            raise VismmoeError(f"--image-dir {d}: not a directory; create it or leave the option out")
        resolved.append(real)
    return tuple(resolved)


def visual_token_estimator(processor: Any) -> Any:
    """(width, height) -> visual tokens, from the image processor's own arithmetic (no pixels needed), or None
    when the family's processor cannot say; the exact count is checked again after encoding."""
    image_processor = getattr(processor, "image_processor", None)
    count = getattr(image_processor, "get_number_of_image_patches", None)
    if count is None:
        return None
    merge = int(getattr(image_processor, "merge_size", 1) or 1)

    def estimate(width: int, height: int) -> int:
        try:
            return int(count(height, width, {})) // (merge * merge)
        except Exception:  # an odd size the arithmetic refuses: the exact check after encoding still applies
            return 0

    return estimate


def video_processor_for(processor: Any, frame_pixels: int) -> Any:
    """The model's video processor with each frame capped at `frame_pixels` (set on the processor the worker
    encodes with, so that the handlers' token counts and the worker's frames agree); None without one."""
    if getattr(processor, "video_processor", None) is None:
        return None
    from vismmoe_edge.models.video_processing import set_frame_pixels

    set_frame_pixels(processor, frame_pixels)
    return processor.video_processor


class Signals:
    """Signal handlers only set flags: the main loop acts on them (no locks taken inside a handler)."""

    def __init__(self, service: Service | None) -> None:
        self.service = service
        self.httpd: TCPServer | UnixServer | None = None
        self.terminate = False
        self.reload = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_terminate)
        signal.signal(signal.SIGINT, self.on_terminate)
        signal.signal(signal.SIGHUP, self.on_hangup)

    def on_terminate(self, signum: int, frame: object) -> None:
        worker = self.service.worker if self.service is not None else None
        if self.terminate and worker is not None:
            worker.cancel_all.set()  # a second SIGTERM/SIGINT: cancel now instead of after --drain-timeout
        self.terminate = True
        if self.service is None or self.service.state == "loading":
            self.abandon_start()

    def abandon_start(self) -> None:
        """A load cannot be drained, only abandoned: exit 0 here, from the handler. An exception raised instead
        lands anywhere in the load, inside an extension's import too, where torch aborts (134) and transformers
        turns it into an ImportError (1). Loading in a thread instead would move torch's OpenMP pool to a thread
        that exits, and later decode runs 30x slower on a small CPU."""
        if self.service is not None:
            self.service.state = "stopped"
        log.info("terminated while loading")
        sdnotify.stopping()
        if self.httpd is not None:
            self.httpd.server_close()  # the Unix socket's file goes with it; the HTTP thread dies with the process
        logging.shutdown()
        os._exit(0)

    def on_hangup(self, signum: int, frame: object) -> None:
        self.reload = True


def serve(options: ServeOptions) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status (2: a configuration error)."""
    signals = Signals(None)
    signals.install()  # first: a SIGTERM during start-up must still exit 0
    httpd: TCPServer | UnixServer | None = None
    service: Service | None = None
    use_mmap_for_large_allocations()
    try:
        service = signals.service = Service(options)
        httpd = signals.httpd = start_http(options, service)
        sdnotify.extend_timeout(int(options.load_timeout_s * 1e6))
        sdnotify.status("loading the model")
        service.load()
    except VismmoeError as e:  # a bad model path, option, profile or address: restarting cannot fix it
        if service is not None:
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
    httpd = make_server(options.host, options.port, options.unix_socket, service, options.socket_mode)
    service.listener = httpd
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True).start()
    if options.unix_socket is None and not service.policy.loopback_only and not options.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use the model", options.host)
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
