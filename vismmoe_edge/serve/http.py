"""HTTP: the request handler (routing, bodies, JSON and server-sent events) and the TCP and Unix-socket servers.

Handler threads parse and validate a request, hand it to the worker's queue and relay its events; they never
touch the model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import select
import socket
import socketserver
import stat
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlparse

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve.images import load_image_url
from vismmoe_edge.serve.protocol import (
    ApiError,
    Completion,
    bad_request,
    chunk,
    completion_body,
    parse_chat_request,
    timeout_error,
    unavailable,
    usage,
)

if TYPE_CHECKING:
    import threading

    from vismmoe_edge.serve.metrics import Metrics
    from vismmoe_edge.serve.protocol import ChatRequest, Limits
    from vismmoe_edge.serve.worker import Job

log = logging.getLogger("vismmoe_edge.serve")
POLL_S = 0.1  # how often a waiting handler checks its client and deadline


class Service(Protocol):
    """What the handlers use of the daemon's Service (serve/daemon.py), which imports this module."""

    state: str
    model_id: str
    limits: Limits
    image_dir: Path | None
    metrics: Metrics
    handlers: int
    handlers_lock: threading.Lock

    def check_model(self, model: object) -> None: ...
    def submit(self, request: ChatRequest, arrival: float) -> Job: ...
    def health(self) -> dict[str, Any]: ...
    def models(self) -> list[dict[str, Any]]: ...
    def render_metrics(self) -> str: ...


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
            service = self.service
            request = parse_chat_request(
                body, service.limits, lambda url, param: load_image_url(url, param, service.limits, service.image_dir)
            )
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
            elif kind == "error":
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


def make_server(host: str, port: int, unix_socket: Path | None, service: Service) -> TCPServer | UnixServer:
    try:
        if unix_socket is not None:
            return UnixServer(unix_socket, service)
        return TCPServer(host, port, service)
    except OSError as e:
        where = unix_socket or f"{host}:{port}"
        raise VismmoeError(f"cannot listen on {where}: {e.strerror or e}") from None


