"""The one thread that owns the Engine: the bounded, fair queue of jobs; image decoding once a job's turn has
come; generation through `Engine.stream` and the shared incremental detokenizer; stop strings; cancellation
between tokens; and watchdog pings as the model makes progress."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve import sdnotify
from vismmoe_edge.serve.admission import Admission
from vismmoe_edge.serve.images import decode
from vismmoe_edge.serve.protocol import (
    ApiError,
    ChatRequest,
    Completion,
    Limits,
    bad_request,
    retry_headers,
    shutdown_error,
    timeout_error,
)
from vismmoe_edge.serve.videos import decode_video

if TYPE_CHECKING:
    from vismmoe_edge.engine import Engine
    from vismmoe_edge.prompt import PromptInputs
    from vismmoe_edge.serve.constraints import JsonGrammars
    from vismmoe_edge.serve.metrics import Metrics

log = logging.getLogger("vismmoe_edge.serve")


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


class Job:
    """One request in flight. Events to its handler: ("started"|"delta"|"done"|"error", payload)."""

    def __init__(self, request: ChatRequest, deadline: float, on_cancel: Any) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.request = request
        self.deadline = deadline  # time.monotonic()
        self.queued_at = time.monotonic()
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


class Call:
    """A function for the worker's thread to run before it serves: the daemon's warm-up, compiled on the thread
    that will run the requests, with their thread state (torch.compile guards the calling thread's CPU thread
    count: run 15's warm-up on the loading thread, which runs on one, left the first request after a cached frame
    to compile again, 2.0 s)."""

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # re-raised on the caller's thread
            self.error = e
        finally:
            self.done.set()


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

    def __init__(
        self, engine: Engine, limits: Limits, metrics: Metrics, grammars: Any = None, threads: int | None = None
    ) -> None:
        self.engine = engine
        self.threads = threads  # torch's CPU threads for this thread's work (daemon.py: the load ran on one)
        self.limits = limits
        self.metrics = metrics
        self.grammars: JsonGrammars | None = grammars  # built on the first response_format request
        self.jobs: queue.Queue[Job | Call] = queue.Queue()  # jobs bounded by `admission`; calls before serving
        self.admission = Admission(limits.max_queue)
        self.heartbeat = Heartbeat(sdnotify.watchdog_interval())
        if self.heartbeat.interval_s is not None:
            install_progress_pings(engine, self.heartbeat)
        self.tick_s = min(0.5, self.heartbeat.interval_s / 2) if self.heartbeat.interval_s else 0.5
        self.max_positions = int(getattr(engine.text_config, "max_position_embeddings", 0) or 0)
        self.pending = 0  # queued + running: drained when 0
        self.lock = threading.Lock()  # pending, the queue's admission and `running`
        self.running: Job | None = None
        self.running_since = 0.0
        self.cancel_all = threading.Event()  # shutdown: in-flight work stops at the next token
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="vismmoe-worker", daemon=True)

    # -- queue side (handler threads) --
    def submit(self, job: Job, client: str) -> None:
        """Queue the job, or refuse it with 429 and the expected wait; `client` identifies retries (admission.py)."""
        with self.lock:
            elapsed = time.monotonic() - self.running_since if self.running is not None else None
            wait = self.admission.decide(client, self.jobs.qsize(), elapsed)
            if wait is not None:
                raise ApiError(
                    429,
                    f"the request queue is full ({self.limits.max_queue} waiting); retry in {wait:.1f} s",
                    type="rate_limit_exceeded",
                    code="queue_full",
                    headers=retry_headers(wait),
                )
            self.jobs.put_nowait(job)
            self.pending += 1
        self.update_status()

    def call(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the worker's (started) thread, waited for; before serving only."""
        call = Call(fn, args)
        self.jobs.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def idle(self) -> bool:
        return self.pending == 0

    def queue_depth(self) -> int:
        return self.jobs.qsize()

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
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)  # OpenMP's thread count is each thread's own
            # ATen gives a thread its process-wide count at its first use of it: take it now, so that a later
            # set_num_threads on another thread (the loading thread's one) cannot become this thread's count
            torch.get_num_threads()
        trimmed = time.monotonic()  # when freed heap pages last went back to the kernel
        untrimmed = False  # a job has finished since
        while not self.stop.is_set():
            self.heartbeat.beat()  # idle but healthy: the loop itself still turns
            try:
                job = self.jobs.get(timeout=TRIM_IDLE_S if untrimmed else self.tick_s)
            except queue.Empty:
                if untrimmed:  # idle: give freed pages back now, where no request waits for it
                    release_freed_memory()
                    trimmed, untrimmed = time.monotonic(), False
                continue
            if isinstance(job, Call):
                job.run()
                continue
            try:
                self.process(job)
            finally:
                job.request.images.clear()  # the decoded and compressed images go now, not with the handler
                job.request.videos.clear()
                self.job_finished()
                untrimmed = True
                if time.monotonic() - trimmed > TRIM_BUSY_S:  # never idle for long: trim between jobs anyway
                    release_freed_memory()
                    trimmed, untrimmed = time.monotonic(), False

    def job_finished(self) -> None:
        with self.lock:
            self.pending -= 1
        self.update_status()

    def process(self, job: Job) -> None:
        if not job.try_start():
            return  # abandoned while queued: its handler already answered
        start = time.monotonic()
        with self.lock:
            self.running, self.running_since = job, start
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
            seconds = time.monotonic() - start
            seen = len(inputs.image_keys or []) if inputs.vision is not None else 0  # seen_frames.py
            completion.timings |= {"queue_s": start - job.queued_at, "service_s": seconds, "frames_seen": seen}
            self.metrics.record_generation(completion, seconds)
            with self.lock:
                self.admission.times.add(seconds)
            if job.cancel_reason is not None:
                log.info("%s: cancelled (%s) after %d tokens", job.id, job.cancel_reason, completion.completion_tokens)
            job.emit("done", completion)
        except ApiError as e:
            job.emit("error", e)
        except VismmoeError as e:  # e.g. non-finite logits: the model, not the request, is at fault
            log.error("request %s failed: %s", job.id, e)
            job.emit("error", ApiError(500, str(e), type="server_error", code="model_error"))
        except Exception as e:  # a bug or a device failure: answer 500 and keep serving
            log.exception("request %s failed", job.id)
            job.emit("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        finally:
            job.finish()  # a client leaving after this point cancels nothing
            with self.lock:
                self.running = None

    def encode(self, request: ChatRequest) -> PromptInputs:
        """Decode the images (only now: one request's pixels at a time) and build the prompt; check its length.
        Images seen before, whose vision features are still cached, are neither decoded nor processed."""
        from vismmoe_edge import seen_frames  # the engine's torch side: this module stays importable without it

        datas = [image.data for image in request.images]
        videos = len(request.videos)
        fast = request.prefix_cache and seen_frames.applies(self.engine, request.messages, len(datas), videos)
        frames = seen_frames.frame_keys(self.engine, datas) if fast else []
        inputs = seen_frames.encode_seen(self.engine, request.messages, frames) if fast else None
        if inputs is None:
            inputs = self.decode_and_encode(request)
            if fast:
                seen_frames.remember(self.engine, frames, inputs)
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

    def decode_and_encode(self, request: ChatRequest) -> PromptInputs:
        images = [decode(image) for image in request.images]
        clips = [decode_video(video) for video in request.videos]
        try:
            return self.engine.encode_messages(request.messages, images, clips)
        except (VismmoeError, ValueError) as e:
            raise bad_request(f"cannot build the prompt: {e}", "messages") from None
        finally:
            del images, clips

    def should_stop(self, job: Job) -> bool:
        """Polled by the engine between tokens, so it also carries the watchdog ping of a healthy decode."""
        self.heartbeat.beat()
        if self.cancel_all.is_set():
            job.cancel("shutdown")
        elif time.monotonic() > job.deadline:
            job.cancel("deadline")
        return job.cancel_reason is not None

    def sampling(self, request: ChatRequest) -> Any:
        from vismmoe_edge.sampling import SamplingConfig

        processors: list[Any] = []
        if request.logit_bias or request.presence_penalty or request.frequency_penalty:
            from vismmoe_edge.serve.constraints import LogitBias, Penalties

            if request.logit_bias:
                processors.append(LogitBias(request.logit_bias))
            if request.presence_penalty or request.frequency_penalty:
                processors.append(Penalties(request.presence_penalty, request.frequency_penalty))
        if request.response_format is not None:
            grammars = self.json_grammars()
            grammar = request.response_format.get("grammar") or grammars.compile(request.response_format)
            processors.append(grammars.processor(grammar))
        return SamplingConfig(
            max_new_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            min_new_tokens=request.min_tokens,
            logits_processors=processors,
        )

    def json_grammars(self) -> JsonGrammars:
        if self.grammars is None:
            from vismmoe_edge.serve.constraints import JsonGrammars

            vocab = int(getattr(self.engine.text_config, "vocab_size", 0) or len(self.engine.processor.tokenizer))
            self.grammars = JsonGrammars(self.engine.processor.tokenizer, vocab, self.engine.eos_token_ids)
        return self.grammars

    def generate(self, job: Job, inputs: PromptInputs) -> Completion:
        """The engine's own generator and the CLI's detokenizer; what is ours is stop strings and cancellation."""
        from vismmoe_edge.detokenize import TextStream
        from vismmoe_edge.engine import Timings

        req = job.request
        stop_ids = set(self.engine.eos_token_ids)
        detok = TextStream(self.engine.processor.tokenizer)
        stops = StopMatcher(req.stop)
        timings = Timings()
        text: list[str] = []
        tokens: list[int] = []
        produced, finish, hit = 0, None, False
        self.metrics.absorb_expert_stats(self.engine.experts.pipeline)  # what prefetch did while idle
        sampling = self.sampling(req)
        stream = self.engine.stream(
            inputs, sampling, timings=timings, should_stop=lambda: self.should_stop(job), use_cache=req.prefix_cache
        )
        with contextlib.closing(stream):
            for token in stream:
                produced += 1
                tokens.append(token)
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
        return Completion("".join(text), finish, inputs.num_tokens, produced, timings.as_dict(), experts, tokens)

    def emit_text(self, job: Job, piece: str, text: list[str]) -> None:
        if piece:
            text.append(piece)
            if job.request.stream:
                job.emit("delta", piece)

    def finish_reason(self, job: Job, produced: int) -> str:
        """Out of tokens ("length"); a deadline returns what exists as "length"; a shutdown is an error."""
        if job.cancel_reason == "shutdown":
            raise shutdown_error()
        if job.cancel_reason == "deadline" and produced == 0:
            raise timeout_error()
        return "length"

    def update_status(self) -> None:
        with self.metrics.lock:
            tps, done = self.metrics.last_decode_tps, self.metrics.completed
        sdnotify.status(f"serving {self.pending} requests, {tps:.1f} tok/s, {done} done")


# malloc_trim takes ~2 ms here and more in a process holding a large model: after every job it delayed the next
# question about a frame, sent as soon as the answer came (docs/benchmarks.md, "One frame, many questions")
TRIM_IDLE_S = 0.1  # after a job, trim once the worker has had no job for this long
TRIM_BUSY_S = 10.0  # ... or right after a job, if it has been busy without a pause this long


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
M_MMAP_THRESHOLD = -3


def use_mmap_for_large_allocations(threshold: int = 4 << 20) -> None:
    """glibc raises its mmap threshold after each large free (up to 32 MiB), after which image-sized buffers come
    from heaps that are not given back; a fixed threshold keeps them mmapped, so freeing them frees memory."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(M_MMAP_THRESHOLD, threshold)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the kernel after a job (glibc keeps them otherwise; RSS would stay high)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
