"""HTTP: the request handler (checks, routing, bodies, JSON and server-sent events).

Handler threads check who is asking (serve/policy.py), read a bounded body (serve/bodies.py), have the Service
parse and queue the request, and relay its events; they never touch the model. Every error, including those
http.server raises itself (400, 414, 431, 501), is answered in OpenAI's JSON shape.
"""

from __future__ import annotations

import io
import json
import logging
import queue
import select
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlparse

from vismmoe_edge.serve.bodies import ByteBudget, read_body
from vismmoe_edge.serve.deadlines import DeadlineReader
from vismmoe_edge.serve.protocol import (
    ApiError,
    Completion,
    busy,
    chunk,
    completion_body,
    http_error,
    timeout_error,
    unavailable,
    usage,
)

if TYPE_CHECKING:
    import threading

    from vismmoe_edge.serve.metrics import Metrics
    from vismmoe_edge.serve.policy import HttpPolicy
    from vismmoe_edge.serve.protocol import Limits
    from vismmoe_edge.serve.worker import Job

log = logging.getLogger("vismmoe_edge.serve")
POLL_S = 0.1  # how often a waiting handler checks its client and deadline
LINGER_S = 1.0  # at most this long, after refusing a request before its body, reading what the client still sends
ROUTES = {"/health": "GET", "/metrics": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST"}
JSON_TYPES = ("application/json",)


class Service(Protocol):
    """What the handlers use of the daemon's Service (serve/daemon.py, which imports this module)."""

    state: str
    model_id: str
    limits: Limits
    policy: HttpPolicy
    metrics: Metrics
    bodies: ByteBudget
    handlers: int
    handlers_lock: threading.Lock

    def start_chat(self, data: bytes, peer: str) -> Job: ...
    def health(self) -> dict[str, Any]: ...
    def models(self) -> list[dict[str, Any]]: ...
    def render_metrics(self) -> str: ...


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for JSON answers; SSE answers close the connection
    default_request_version = "HTTP/1.0"  # a garbled request line still gets a status line (not HTTP/0.9's none)
    server_version = "vismmoe-edge"
    timeout = 30  # per socket operation: an idle keep-alive connection or a stalled client frees its thread
    server: Any  # serve/servers.py's TCPServer or UnixServer
    cors_origin: str | None = None
    body_read = False  # the current request's body has been read (unread_body)

    @property
    def service(self) -> Service:
        return self.server.service

    def setup(self) -> None:
        super().setup()
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            # A reply goes out as two writes, head then body. With Nagle's algorithm the body waited for the
            # client's delayed ACK of the head: ~40 ms on every request after the first on a kept-alive
            # connection (the official openai client keeps its connections), whatever the model's speed.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()  # the plain socket file: every read goes through the deadlines instead
        self.reader = DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self.reader, 65536)

    def handle_one_request(self) -> None:
        """One request, its request line and headers within --header-timeout; a client that started a request
        and did not finish its headers in time gets a 408 (an idle keep-alive connection is just closed)."""
        self.body_read = False
        self.reader.start("headers", self.header_timeout())
        super().handle_one_request()  # catches the TimeoutError of a late request and closes the connection
        if self.reader.expired and self.reader.phase == "headers" and self.reader.received:
            self.close_connection = True
            self.command, self.request_version, self.requestline = "", "HTTP/1.1", ""
            self.send_error_json(http_error(408, "the request headers did not arrive in time (--header-timeout)"))

    def header_timeout(self) -> float:
        return self.service.limits.header_timeout_s

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self.unread_body():
                self.linger()

    def unread_body(self) -> bool:
        """A POST whose declared body was never read: refused before it (admit(), loading or draining, a wrong
        Content-Type)."""
        headers = getattr(self, "headers", None)
        if headers is None or getattr(self, "command", None) != "POST" or self.body_read:
            return False
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            return True
        try:
            return int(headers.get("Content-Length") or 0) > 0
        except ValueError:
            return False

    def linger(self) -> None:
        """Half-close, then read and drop what the client still sends, for at most LINGER_S and the body limit.
        A socket closed with unread bytes resets the connection (TCP) or breaks the pipe of a client still
        writing its body (a unix socket; http.client writes the head and the body apart), and the client can
        lose the reply it was sent: a 503 while the model loads or the daemon drains came back as BrokenPipeError
        (tests/test_server.py)."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            end = time.monotonic() + LINGER_S
            left = self.service.limits.max_body_bytes + 65536
            while left > 0 and (wait := end - time.monotonic()) > 0:
                self.connection.settimeout(wait)
                data = self.connection.recv(min(65536, left))
                if not data:
                    return
                left -= len(data)
        except OSError:  # timed out, or the client is gone: the close is all that is left
            pass

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def address_string(self) -> str:
        return str(self.client_address[0]) if self.client_address else "unix"

    # -- checks and routing --
    def admit(self, method: str) -> str | None:
        """The request's path if it may be served; otherwise it has been answered and None is returned."""
        path = urlparse(self.path).path
        self.cors_origin = None
        try:
            origin = self.headers.get("Origin")
            self.service.policy.check(self.headers.get("Host"), origin, self.headers.get("Authorization"), path)
            if origin is not None:
                self.cors_origin = origin  # allowed, or check() would have refused
            allowed = ROUTES.get(path) or ("GET" if path.startswith("/v1/models/") else None)
            if allowed is None:
                raise ApiError(404, f"no route {method} {path[:200]}", code="not_found")
            if method != allowed:
                raise http_error(405, f"{path} takes {allowed}, not {method}", headers={"Allow": allowed})
        except ApiError as e:
            self.close_connection = True
            self.send_error_json(e)
            return None
        return path

    def do_GET(self) -> None:
        path = self.admit("GET")
        if path == "/health":
            health = self.service.health()
            self.send_json(200 if health["status"] == "ok" else 503, health)
        elif path == "/metrics":
            self.send_bytes(200, self.service.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": self.service.models()})
        elif path is not None:
            wanted = unquote(path.removeprefix("/v1/models/"))
            found = [m for m in self.service.models() if m["id"] == wanted]
            if found:
                self.send_json(200, found[0])
            else:
                error = ApiError(404, f"the model {wanted[:100]!r} does not exist", code="model_not_found")
                self.send_error_json(error)

    def do_POST(self) -> None:
        if self.admit("POST") is None:
            return
        with self.service.handlers_lock:
            self.service.handlers += 1
        try:
            self.chat_completions()
        except Exception as e:  # a bug: answer 500 in OpenAI's shape rather than drop the connection
            log.exception("chat completion failed")
            self.close_connection = True
            self.refuse(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))
        finally:
            with self.service.handlers_lock:
                self.service.handlers -= 1

    def do_OPTIONS(self) -> None:
        """CORS preflight: answered for allowed origins only; a preflight carries no API key."""
        path = urlparse(self.path).path
        origin = self.headers.get("Origin")
        try:
            self.service.policy.check(self.headers.get("Host"), origin, None, "/")
            if origin is None:
                raise http_error(405, "OPTIONS is for CORS preflights", headers={"Allow": "GET, POST"})
            if path not in ROUTES and not path.startswith("/v1/models/"):
                raise ApiError(404, f"no route {path[:200]}", code="not_found")
        except ApiError as e:
            self.close_connection = True
            self.send_error_json(e)
            return
        self.cors_origin = origin
        headers = {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
        }
        self.send_bytes(204, b"", "text/plain", headers)

    def do_PUT(self) -> None:
        self.admit("PUT")

    def do_DELETE(self) -> None:
        self.admit("DELETE")

    def do_PATCH(self) -> None:
        self.admit("PATCH")

    # -- responses --
    def end_headers(self) -> None:
        if self.cors_origin is not None:
            self.send_header("Access-Control-Allow-Origin", self.cors_origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and status >= 200 and status not in (204, 304):
                self.wfile.write(data)
        except OSError:
            self.close_connection = True  # the client left; nothing to tell it

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

    def send_error_json(self, error: ApiError) -> None:
        self.send_json(error.status, error.body(), error.headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, 414, 431, 501) in OpenAI's shape instead of HTML."""
        self.close_connection = True
        text = message or HTTPStatus(code).phrase
        if explain and explain != message:
            text = f"{text}: {explain}"
        self.send_error_json(http_error(code, text[:300]))

    # -- chat completions --
    def chat_completions(self) -> None:
        wants_close = self.close_connection  # parse_request() set it from `Connection: close` (or HTTP/1.0)
        self.close_connection = True  # until the body is read: unread bytes must not pass for the next request
        taken = 0
        try:
            try:
                if self.service.state != "ok":
                    raise unavailable(self.service.state)
                media = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
                if media not in JSON_TYPES:
                    raise http_error(415, f"Content-Type must be application/json, not {media[:60] or 'missing'!r}")
                limit = self.service.limits.max_body_bytes
                self.reader.start("body", self.service.limits.body_timeout_s)
                try:
                    data, taken = read_body(self.rfile, self.headers, limit, self.service.bodies)
                    self.body_read = True
                finally:
                    self.reader.start("reply", None)  # no read deadline while the reply is generated
                self.close_connection = wants_close
                job = self.service.start_chat(data, self.server.peer(self.connection, self.client_address))
                del data  # the request keeps only what it needs (compressed images, text)
            except ApiError as e:
                self.refuse(e)
                return
            if job.request.stream:
                self.answer_stream(job)
            else:
                self.answer_blocking(job)
        finally:
            self.service.bodies.give(taken)

    def refuse(self, error: ApiError) -> None:
        self.service.metrics.record_response(error.status)
        log.info("chat completion refused: %d %s", error.status, error.message[:200])
        self.send_error_json(error)

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
                self.send_json(200, completion_body(job.id, job.created, self.service.model_id, payload))
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
            self.send_event(self.chunk(job, {"role": "assistant", "content": ""}, None))
            self.relay(job, event)
        except OSError:  # BrokenPipeError, ConnectionResetError: the client left mid-stream
            job.cancel("client_disconnect")

    def relay(self, job: Job, event: tuple[str, Any] | None) -> None:
        while event is not None:
            kind, payload = event
            if kind == "delta":
                self.send_event(self.chunk(job, {"content": payload}, None))
            elif kind == "done":
                self.send_event(self.chunk(job, {}, payload.finish_reason))
                if job.request.include_usage:
                    self.send_event({**self.chunk(job, {}, None), "choices": [], "usage": usage(payload)})
                self.send_sse("[DONE]")
                self.log_done(job, payload)
                return
            elif kind == "error":  # e.g. cut by a shutdown: an error, never a normal end
                log.info("%s: ended with an error: %s", job.id, payload.message)
                self.send_event(payload.body())
                self.send_sse("[DONE]")
                return
            event = self.next_event(job)

    def chunk(self, job: Job, delta: dict, finish: str | None) -> dict[str, Any]:
        return chunk(job.id, job.created, self.service.model_id, delta, finish)

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


class ProbeHandler(Handler):
    """A connection past the connection caps: one GET /health or /metrics is answered (a probe must see a busy
    daemon as alive), anything else gets the 503 the caps give; then the connection closes."""

    PROBES = ("/health", "/metrics")
    PROBE_HEADER_S = 2.0

    def __init__(self, request: Any, client_address: Any, server: Any, free_slot: Callable[[], None]) -> None:
        self.free_slot = free_slot
        super().__init__(request, client_address, server)

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def header_timeout(self) -> float:
        return min(self.PROBE_HEADER_S, self.service.limits.header_timeout_s)

    def admit(self, method: str) -> str | None:
        # The head is read: this connection can no longer hold a probe slot by trickling bytes. Freed before the
        # answer is written, so a client that has its answer finds the slot free for its next probe.
        self.free_slot()
        self.close_connection = True
        if method == "GET" and urlparse(self.path).path in self.PROBES:
            return super().admit(method)
        reason = self.server.cap_reason(self.server.peer(self.connection, self.client_address))
        self.send_error_json(busy(f"{reason}; retry shortly", "too_many_connections"))
        return None

    def do_OPTIONS(self) -> None:
        self.admit("OPTIONS")
