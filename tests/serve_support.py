"""Helpers for the daemon's tests: a real `serve` subprocess, a systemd notify listener, HTTP and SSE clients."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
LONG = 3000  # tokens: a generation that outlasts any test step (the demo decodes ~100 tok/s here)
JSON = "application/json"
JSON_HEADER = f"Content-Type: {JSON}\r\n"


class NotifyListener:
    """Plays systemd's end of $NOTIFY_SOCKET: collects the datagrams the server sends."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while not self.closed:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def lines(self) -> list[str]:
        return [line for message in list(self.messages) for line in message.split("\n")]

    def wait_for(self, line: str, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if line in self.lines():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class Server:
    """A `python -m vismmoe_edge.cli serve` subprocess; its log goes to a file (a full pipe would block it)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str], unix_socket: Path | None = None):
        self.log_path = log_path
        self.unix_socket = unix_socket
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vismmoe_edge.cli", "serve", *args],
                stdout=log,
                stderr=log,
                env=full_env,
                cwd=REPO,
            )
        self.port = 0

    def wait_ready(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.log()
            if " ready: " in text:
                if self.unix_socket is None:
                    self.port = int(text.split("ready: ", 1)[1].split("127.0.0.1:", 1)[1].split()[0])
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"the server did not become ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def connection(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        if self.unix_socket is not None:
            return UnixHTTPConnection(str(self.unix_socket), timeout)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def raw_socket(self) -> socket.socket:
        if self.unix_socket is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(self.unix_socket))
        else:
            sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(30)
        return sock

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
        conn = self.connection()
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            ctype = resp.getheader("Content-Type", "")
            return resp.status, dict(resp.getheaders()), json.loads(raw) if "json" in ctype else raw.decode()
        finally:
            conn.close()

    def chat(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, _, payload = self.request("POST", "/v1/chat/completions", body)
        return status, payload

    def metrics(self) -> dict[str, float]:
        status, _, text = self.request("GET", "/metrics")
        assert status == 200
        return parse_prometheus(text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def parse_prometheus(text: str) -> dict[str, float]:
    """{'name{labels}': value} from the text format; every sample line must parse."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")) or not line, line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def iter_sse(resp: http.client.HTTPResponse) -> Iterator[Any]:
    """Parsed `data:` payloads of a server-sent event stream; "[DONE]" as a string."""
    for raw in iter(resp.readline, b""):
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)
        else:
            assert line == "", f"unexpected SSE line {line!r}"


def open_stream(server: Server, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = server.connection()
    conn.request(
        "POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}), headers={"Content-Type": JSON}
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type") == "text/event-stream"
    return conn, resp


def start_raw_stream(server: Server, body: dict[str, Any]) -> socket.socket:
    """A streaming request on a bare socket, returned once the first content delta has arrived."""
    sock = server.raw_socket()
    data = json.dumps({**body, "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n{JSON_HEADER}Content-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    received = b""
    while b'"delta": {"content"' not in received:
        part = sock.recv(65536)
        assert part, f"the stream ended early: {received!r}"
        received += part
    return sock


def health(server: Server) -> tuple[int, str]:
    status, _, body = server.request("GET", "/health")
    return status, body["status"]


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def user(text: str, *images: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def assert_error(status: int, payload: Any, expected: int, code: str | None = None) -> None:
    assert status == expected, payload
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert payload["error"]["message"]
    if code is not None:
        assert payload["error"]["code"] == code, payload


def random_demo_model() -> Path:
    """The tiny random-weight demo: these tests exercise the server, and its 64-token image cap keeps them fast."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import ensure_random_demo_model

    return ensure_random_demo_model()
