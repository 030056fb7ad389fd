"""The listening side: a TCP or Unix-socket server with one thread per connection, and caps on connections.

Past --max-connections, or past --max-connections-per-client for one client (IP address, or uid on the Unix
socket: one client can never take the last slots), a new connection is answered 503 at once from the accepting
thread and closed, so a flood of idle or slow clients costs no thread and cannot grow memory without bound.
A few connections past the caps (PROBE_SLOTS) are still read, briefly, for a probe: GET /health and /metrics
are answered even while slow clients hold every slot, and anything else gets the 503.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import stat
import struct
import threading
from collections import Counter
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve.http import Handler, ProbeHandler, Service
from vismmoe_edge.serve.protocol import busy

PROBE_SLOTS = 4  # connections past the caps read for a /health or /metrics probe
PROBE_SLOTS_PER_CLIENT = 2  # so that one client trickling bytes cannot hold them all


class ServerMixin:
    service: Service
    request_queue_size = 64  # listen backlog: a burst of clients gets queued or a 429, not a refused connection
    daemon_threads = True

    def init_cap(self, max_connections: int, per_client: int) -> None:
        self.max_connections = max_connections
        self.max_per_client = per_client
        self.connections = 0
        self.per_client: Counter[str] = Counter()
        self.probes: Counter[str] = Counter()
        self.refused = 0  # connections answered 503 at the caps without being read
        self.connections_lock = threading.Lock()

    def connection_samples(self) -> list[Any]:
        """For /metrics: an operator sees a flood of connections before clients see 503s."""
        with self.connections_lock:
            held, probes, refused = self.connections, self.probes.total(), self.refused
        return [
            ("vismmoe_open_connections", "gauge", "connections held now, the one asking included", [({}, held)]),
            ("vismmoe_open_connections_limit", "gauge", "--max-connections", [({}, self.max_connections)]),
            ("vismmoe_probe_connections", "gauge", "connections past the caps read for a probe", [({}, probes)]),
            ("vismmoe_connections_refused_total", "counter", "connections refused at the caps", [({}, refused)]),
        ]

    def process_request(self, request: Any, client_address: Any) -> None:
        client = peer_identity(request, client_address)
        with self.connections_lock:
            full = self.connections >= self.max_connections
            crowded = self.per_client[client] >= self.max_per_client
            admitted = not full and not crowded
            probe = not admitted and self.probes.total() < PROBE_SLOTS
            probe = probe and self.probes[client] < PROBE_SLOTS_PER_CLIENT
            if admitted:
                self.connections += 1
                self.per_client[client] += 1
            elif probe:
                self.probes[client] += 1
            else:
                self.refused += 1
        if admitted:
            try:
                super().process_request(request, client_address)  # type: ignore[misc]
            except BaseException:
                self.release(client)
                raise
            return
        if not probe:
            refuse_connection(request, self.cap_reason(client))
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        threading.Thread(target=self.serve_probe, args=(request, client_address, client), daemon=True).start()

    def serve_probe(self, request: Any, client_address: Any, client: str) -> None:
        freed = False

        def free_slot() -> None:
            nonlocal freed
            with self.connections_lock:
                if not freed:
                    freed = True
                    self.probes[client] -= 1
                    if self.probes[client] <= 0:
                        del self.probes[client]

        try:
            ProbeHandler(request, client_address, self, free_slot)
        except Exception:  # noqa: S110 - a probe connection that fails is simply closed
            pass
        finally:
            free_slot()
            self.shutdown_request(request)  # type: ignore[attr-defined]

    def cap_reason(self, client: str) -> str:
        if self.per_client[client] >= self.max_per_client:
            return f"too many open connections from this client (the limit is {self.max_per_client})"
        return f"too many open connections (the limit is {self.max_connections})"

    def release(self, client: str) -> None:
        with self.connections_lock:
            self.connections -= 1
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]

    def peer(self, sock: socket.socket, address: Any) -> str:
        return peer_identity(sock, address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        client = peer_identity(request, client_address)
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self.release(client)


def refuse_connection(sock: socket.socket, reason: str) -> None:
    """503 in OpenAI's shape, written without reading the request (it may never come)."""
    error = busy(f"{reason}; retry shortly", "too_many_connections")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {error.headers['Retry-After']}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.recv(65536)  # what has arrived already: unread data would turn our close into a reset
        sock.settimeout(0.5)
        sock.sendall(head.encode() + body)


class TCPServer(ServerMixin, ThreadingHTTPServer):
    def __init__(self, host: str, port: int, service: Service) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.service = service
        self.init_cap(service.limits.max_connections, service.limits.max_connections_per_client)
        super().__init__((host, port), Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would do a reverse DNS lookup of the host
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def url(self) -> str:
        host = self.server_name
        return f"http://[{host}]:{self.server_port}" if ":" in host else f"http://{host}:{self.server_port}"


class UnixServer(ServerMixin, ThreadingHTTPServer):
    address_family = socket.AF_UNIX

    def __init__(self, path: Path, service: Service, mode: int = 0o660) -> None:
        self.service = service
        self.path = path
        self.mode = mode
        self.init_cap(service.limits.max_connections, service.limits.max_connections_per_client)
        super().__init__(str(path), Handler)

    def server_bind(self) -> None:
        remove_stale_socket(self.path)
        old = os.umask(0o177)  # created 0600 at most: never, even for an instant, what the umask allows
        try:
            socketserver.TCPServer.server_bind(self)
        finally:
            os.umask(old)
        self.bound = True  # from now on the socket file is ours to remove
        os.chmod(self.path, self.mode)  # the daemon's mode (--socket-mode), not the umask's
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


def peer_identity(sock: socket.socket, address: Any) -> str:
    """Who is on the other end: the IP address, or on a Unix socket the peer's uid (SO_PEERCRED)."""
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError, AttributeError):
            _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return f"uid:{uid}"
        return "unix"
    return str(address[0]) if address else "?"


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


def make_server(
    host: str, port: int, unix_socket: Path | None, service: Service, socket_mode: int = 0o660
) -> TCPServer | UnixServer:
    try:
        if unix_socket is not None:
            return UnixServer(unix_socket, service, socket_mode)
        return TCPServer(host, port, service)
    except OSError as e:
        where = unix_socket or f"{host}:{port}"
        raise VismmoeError(f"cannot listen on {where}: {e.strerror or e}") from None
