"""The daemon under hostile clients (issue 22): every budget comes back, memory is bounded before parsing, every
read has a deadline.

One real daemon (the random demo model) with short deadlines set by options, so that stalls take a second, not
the default tens of seconds; the clients are raw sockets (an attacker's) and the official openai client.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_support import Server, assert_error, random_demo_model, user, wait_until
from test_serve_security import post_head, raw_request

DEADLINE = 1.0  # --header-timeout and --body-timeout of the daemon under test


def start(tmp: Path, *args: str) -> Server:
    common = ["--model", str(random_demo_model()), "--port", "0", "--memory-budget", "100%", "--pinned-layers", "0"]
    common += ["--tier", "host", "--header-timeout", str(DEADLINE), "--body-timeout", str(DEADLINE)]
    return Server([*common, *args], tmp / "server.log", {})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start(tmp_path_factory.mktemp("hostile"), "--max-connections", "12", "--max-connections-per-client", "8")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def pending(server: Server) -> float:
    return server.metrics()["vismmoe_pending_request_bytes"]


def read_reply(sock: socket.socket, timeout: float = 10) -> tuple[int, dict]:
    """One HTTP response from a socket on which a request was sent."""
    import http.client

    sock.settimeout(timeout)
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, json.loads(resp.read())


# ---- budgets come back on every path ------------------------------------------------------------------------


def test_a_stalled_body_is_408_and_its_budget_comes_back(server: Server) -> None:
    """Declared 1 MiB, never sent: 408 after --body-timeout (not 500), and the pending bytes return to 0."""
    socks = [server.raw_socket() for _ in range(4)]
    for sock in socks:
        sock.sendall(post_head(str(1 << 20)) + b'{"messages": ')
    assert wait_until(lambda: pending(server) == 4 << 20, timeout=DEADLINE / 2 + 0.5)
    started = time.monotonic()
    for sock in socks:
        status, payload = read_reply(sock)
        assert_error(status, payload, 408, "request_timeout")
        sock.close()
    assert time.monotonic() - started < DEADLINE + 3
    assert pending(server) == 0
    status, reply = server.chat({"messages": user("hi"), "max_tokens": 2})
    assert status == 200, reply  # nobody is locked out


def test_a_client_that_leaves_mid_body_gives_its_budget_back(server: Server) -> None:
    sock = server.raw_socket()
    sock.sendall(post_head(str(1 << 20)) + b"x" * 1000)
    assert wait_until(lambda: pending(server) == 1 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with a reset
    sock.close()
    assert wait_until(lambda: pending(server) == 0, timeout=5)


def test_a_malformed_chunked_body_gives_its_budget_back(server: Server) -> None:
    head = post_head(None, "Transfer-Encoding: chunked\r\n")
    status, _, payload = raw_request(server, head, b"10\r\n" + b"x" * 16 + b"\r\nzz\r\n")
    assert_error(status, payload, 400, "bad_framing")
    assert pending(server) == 0


# ---- deadlines on headers ----------------------------------------------------------------------------------


def test_headers_sent_a_byte_at_a_time_get_408(server: Server) -> None:
    sock = server.raw_socket()
    started = time.monotonic()
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: localhost\r\n":
            if select.select([sock], [], [], 0.1)[0]:  # answered: stop sending (more bytes would reset it)
                break
            sock.sendall(bytes([byte]))
        status, payload = read_reply(sock)
    finally:
        sock.close()
    assert_error(status, payload, 408, "request_timeout")
    assert time.monotonic() - started < DEADLINE + 2
