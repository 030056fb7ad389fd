"""The daemon as an attacker meets it (issue 14): local files, existence oracles, browsers, framing, big inputs.

Real daemons (the random demo model) over real sockets; files, symlinks and FIFOs are real, and one client runs
as another user (nobody) over the Unix socket.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_support import Server, assert_error, data_url, parse_prometheus, random_demo_model, user


def png_bytes(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def raw_request(server: Server, head: bytes, body: bytes = b"", timeout: float = 10) -> tuple[int, dict, Any]:
    """Send bytes as they are; read one response (JSON parsed)."""
    sock = server.raw_socket()
    sock.settimeout(timeout)
    try:
        sock.sendall(head + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        data = resp.read()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, dict(resp.getheaders()), json.loads(data) if "json" in ctype else data
    finally:
        sock.close()


def post_head(length: str | None, extra: str = "", content_type: str = "application/json") -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: localhost"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


# ---- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """served/ (the --image-dir) with an image, a symlink out, a symlink within, a FIFO, a big file and a
    subdirectory; secret/ (0700, root) with a 0600 image; a directory that is not an image."""
    root = tmp_path_factory.mktemp("tree")
    served = root / "served"
    secret = root / "secret"
    served.mkdir()
    secret.mkdir(mode=0o700)
    (served / "ok.png").write_bytes(png_bytes(64, 48))
    (secret / "private.png").write_bytes(png_bytes(64, 48, (0, 0, 0)))
    os.chmod(secret / "private.png", 0o600)
    (served / "out.png").symlink_to(secret / "private.png")  # leads outside
    (served / "outdir").symlink_to(secret)  # a directory symlink out: outdir/private.png
    (served / "alias.png").symlink_to(served / "ok.png")  # stays inside: allowed
    os.mkfifo(served / "fifo.png")
    (served / "big.png").write_bytes(b"\x89PNG" + os.urandom(300 * 1024))  # over --max-image-bytes 200KiB
    (served / "sub").mkdir()
    (root / "notes.txt").write_text("not an image")
    os.chmod(root, 0o755)
    os.chmod(served, 0o755)
    return {"root": root, "served": served, "secret": secret}


def start(tmp: Path, *args: str, unix: Path | None = None) -> Server:
    sock = unix / "api.sock" if unix else None
    listen = ["--listen", f"unix:{sock}"] if unix else ["--port", "0"]
    common = ["--model", str(random_demo_model()), *listen, "--max-image-bytes", "200KiB", "--max-connections", "8"]
    common += ["--memory-budget", "100%", "--pinned-layers", "0", "--tier", "host"]
    return Server([*common, *args], tmp / "server.log", {}, unix_socket=sock)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tree: dict[str, Path]) -> Iterator[dict[str, Server]]:
    """Started together (each spends seconds importing torch): default, with --image-dir, and on a socket."""
    base = tmp_path_factory.mktemp("srv")
    for name in ("default", "dirs", "unix", "keyed"):
        (base / name).mkdir()
    public = Path(tempfile.mkdtemp(prefix="vismmoe-sock-", dir="/tmp"))  # pytest's tmp is 0700: nobody can't enter
    os.chmod(public, 0o755)
    started = {
        "default": start(base / "default"),
        "dirs": start(base / "dirs", "--image-dir", str(tree["served"]), "--allowed-origin", "http://localhost:3000"),
        "unix": start(base / "unix", "--image-dir", str(tree["served"]), unix=public),
        "keyed": start(base / "keyed", "--api-key", "s3cret"),
    }
    try:
        for srv in started.values():
            srv.wait_ready()
        os.chmod(public / "api.sock", 0o666)  # so that user nobody can connect
        yield started
    finally:
        for srv in started.values():
            srv.stop()
        shutil.rmtree(public, ignore_errors=True)


# ---- local files ----------------------------------------------------------------------------------------


def test_local_paths_are_off_by_default(servers: dict[str, Server], tree: dict[str, Path]) -> None:
    srv = servers["default"]
    for url in (str(tree["served"] / "ok.png"), (tree["served"] / "ok.png").as_uri(), "/etc/passwd", "/no/such"):
        status, body = srv.chat({"messages": user("Hi", url), "max_tokens": 2})
        assert_error(status, body, 400, "local_images_disabled")
    assert srv.chat({"messages": user("Hi", data_url(tree["served"] / "ok.png")), "max_tokens": 2})[0] == 200


def test_files_under_the_image_dir_are_served(servers: dict[str, Server], tree: dict[str, Path]) -> None:
    srv = servers["dirs"]
    ok = tree["served"] / "ok.png"
    for url in (str(ok), ok.as_uri(), str(tree["served"] / "alias.png")):
        status, body = srv.chat({"messages": user("Hi", url), "max_tokens": 2})
        assert status == 200, body


OUTSIDE_AND_ODD = [
    "{secret}/private.png",  # exists, readable by the daemon (root), outside
    "{secret}/missing.png",  # does not exist, outside
    "{root}/notes.txt",  # exists, not an image, outside
    "{secret}",  # a directory outside
    "/etc/passwd",
    "/proc/self/environ",
    "{served}/../secret/private.png",  # traversal
    "{served}/sub/../../secret/private.png",
    "{served}/out.png",  # a symlink inside that leads out
    "{served}/outdir/private.png",  # through a directory symlink
    "{served}/missing.png",  # inside, missing
    "{served}/sub",  # inside, a directory
    "{served}/fifo.png",  # inside, a FIFO: must not hang the handler
    "{served}/big.png",  # inside, too large
    "relative/path.png",
]


def refusal(srv: Server, url: str) -> tuple[int, Any, float]:
    start = time.monotonic()
    status, body = srv.chat({"messages": user("Describe.", url), "max_tokens": 2})
    return status, body, time.monotonic() - start


def test_no_file_outside_and_no_existence_oracle(servers: dict[str, Server], tree: dict[str, Path]) -> None:
    """Every refusal is the same status and byte-identical body, whatever the file's existence, type or size."""
    srv = servers["dirs"]
    names = {k: str(v) for k, v in tree.items()}
    answers = {}
    for template in OUTSIDE_AND_ODD:
        path = template.format(**names)
        for url in (path, "file://" + path if path.startswith("/") else path):
            status, body, seconds = refusal(srv, url)
            assert status == 400 and seconds < 5, (url, status, body)
            answers[url] = json.dumps(body, sort_keys=True)
    assert len(set(answers.values())) == 1, answers
    assert "private" not in next(iter(answers.values()))
    status, body, _ = refusal(srv, "file://" + str(tree["served"] / "%2e%2e/secret/private.png"))
    assert json.dumps(body, sort_keys=True) == next(iter(answers.values()))  # percent-encoded traversal


def test_another_user_over_the_socket_gets_nothing(servers: dict[str, Server], tree: dict[str, Path]) -> None:
    """A client running as nobody asks the root daemon for a 0600 file in a 0700 directory."""
    srv = servers["unix"]
    body = json.dumps({"messages": user("Describe.", str(tree["secret"] / "private.png")), "max_tokens": 2})
    missing = json.dumps({"messages": user("Describe.", str(tree["secret"] / "nothing.png")), "max_tokens": 2})
    client = (
        "import http.client, json, socket, sys\n"
        "def ask(body):\n"
        "    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "    c = http.client.HTTPConnection('localhost'); c.sock = s\n"
        "    c.request('POST', '/v1/chat/completions', body, {'Content-Type': 'application/json'})\n"
        "    r = c.getresponse(); return r.status, r.read().decode()\n"
        "print(json.dumps([ask(sys.argv[2]), ask(sys.argv[3])]))\n"
    )
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    python = shutil.which("python3", path="/usr/bin:/bin")  # the venv's lives under /root, closed to nobody
    if python is None:
        pytest.skip("no system python3 for the client")
    out = subprocess.run(
        [python, "-c", client, str(srv.unix_socket), body, missing],
        capture_output=True, text=True, timeout=60, user="nobody", cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (s1, b1), (s2, b2) = json.loads(out.stdout)
    assert s1 == s2 == 400 and b1 == b2 and "image_unavailable" in b1


# ---- browsers and the network --------------------------------------------------------------------------


def test_foreign_host_and_origin_are_refused(servers: dict[str, Server]) -> None:
    srv = servers["dirs"]
    body = json.dumps({"messages": user("Hi"), "max_tokens": 2}).encode()
    for extra in ("Host: attacker.example\r\n", "Host: attacker.example:8000\r\n"):
        head = f"POST /v1/chat/completions HTTP/1.1\r\n{extra}Content-Type: application/json\r\n"
        status, _, payload = raw_request(srv, f"{head}Content-Length: {len(body)}\r\n\r\n".encode(), body)
        assert_error(status, payload, 403, "forbidden_host")
    status, _, payload = raw_request(srv, b"GET /v1/models HTTP/1.1\r\nHost: rebound.example\r\n\r\n")
    assert_error(status, payload, 403, "forbidden_host")  # DNS rebinding reads are refused too
    evil = post_head(str(len(body)), "Origin: http://attacker.example\r\n")
    status, _, payload = raw_request(srv, evil, body)
    assert_error(status, payload, 403, "forbidden_origin")
    good = post_head(str(len(body)), "Origin: http://localhost:3000\r\n")
    status, headers, payload = raw_request(srv, good, body)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000", payload
    preflight = (
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: http://localhost:3000\r\n"
        b"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n\r\n"
    )
    status, headers, _ = raw_request(srv, preflight)
    assert status == 204 and "POST" in headers["Access-Control-Allow-Methods"]
    status, _, payload = raw_request(srv, preflight.replace(b"localhost:3000", b"attacker.example"))
    assert_error(status, payload, 403, "forbidden_origin")
    for host in (b"localhost", b"127.0.0.1", b"[::1]:1234", b"api.localhost"):
        assert raw_request(srv, b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")[0] == 200, host


def test_text_plain_and_form_posts_are_refused(servers: dict[str, Server]) -> None:
    """A page can POST text/plain cross-site without a preflight: the answer must not be 200."""
    srv = servers["default"]
    body = json.dumps({"messages": user("Hi"), "max_tokens": 2}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, _, payload = raw_request(srv, post_head(str(len(body)), content_type=ctype), body)
        assert_error(status, payload, 415, "unsupported_media_type")
    head = post_head(str(len(body)), content_type="application/json; charset=utf-8")
    status, _, payload = raw_request(srv, head, body)
    assert status == 200, payload


def test_api_key(servers: dict[str, Server]) -> None:
    srv = servers["keyed"]
    body = json.dumps({"messages": user("Hi"), "max_tokens": 2}).encode()
    status, headers, payload = raw_request(srv, post_head(str(len(body))), body)
    assert_error(status, payload, 401, "invalid_api_key")
    assert headers["WWW-Authenticate"].startswith("Bearer")
    wrong = post_head(str(len(body)), "Authorization: Bearer nope\r\n")
    assert raw_request(srv, wrong, body)[0] == 401
    right = post_head(str(len(body)), "Authorization: Bearer s3cret\r\n")
    assert raw_request(srv, right, body)[0] == 200
    assert raw_request(srv, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")[0] == 200  # probes need no key
    assert raw_request(srv, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")[0] == 401


def test_api_key_from_the_environment_is_not_in_argv(tmp_path: Path) -> None:
    from serve_support import Server as Srv

    srv = Srv(
        ["--model", str(random_demo_model()), "--port", "0", "--tier", "host", "--pinned-layers", "0"],
        tmp_path / "log",
        {"VISMMOE_EDGE_API_KEY": "from-env"},
    )
    try:
        srv.wait_ready()
        assert "from-env" not in Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert srv.request("GET", "/v1/models")[0] == 401
        conn = srv.connection()
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer from-env"})
        assert conn.getresponse().status == 200
    finally:
        srv.stop()


# ---- framing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "extra"),
    [
        ("-1", ""),
        ("-0", ""),
        ("+5", ""),
        ("5_0", ""),
        ("0x10", ""),
        ("ten", ""),
        ("", ""),
        ("10", "Content-Length: 10\r\n"),  # duplicated, even with the same value
        ("10", "Content-Length: 20\r\n"),
        ("10", "Transfer-Encoding: chunked\r\n"),  # both: the request-smuggling pattern
    ],
)
def test_bad_content_length_is_400_at_once(servers: dict[str, Server], length: str, extra: str) -> None:
    """The daemon answers without waiting for a body (the old one read until the client closed)."""
    start = time.monotonic()
    status, _, payload = raw_request(servers["default"], post_head(length, extra), b"", timeout=5)
    assert_error(status, payload, 400)
    assert time.monotonic() - start < 3


def test_chunked_bodies_are_read_and_bounded(servers: dict[str, Server]) -> None:
    body = json.dumps({"messages": user("Hi"), "max_tokens": 2}).encode()
    chunks = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    head = post_head(None, "Transfer-Encoding: chunked\r\n")
    assert raw_request(servers["default"], head, chunks)[0] == 200
    sock = servers["default"].raw_socket()  # a chunked body that keeps coming: cut at --max-body-bytes
    sock.sendall(head)
    block = b"x" * (1 << 20)
    status = None
    try:
        for _ in range(40):  # 40 MiB against the 32 MiB default
            sock.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n")
    except OSError:
        pass  # the daemon answered and closed: what it said is read below
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    status = resp.status
    sock.close()
    assert status == 413
    bad = head + b"zz\r\n"
    assert raw_request(servers["default"], bad)[0] == 400
    assert raw_request(servers["default"], post_head(None, "Transfer-Encoding: gzip\r\n"))[0] == 501


def test_deep_json_is_a_400_not_a_dropped_connection(servers: dict[str, Server]) -> None:
    for depth in (100_000, 100):
        body = b"[" * depth + b"]" * depth
        status, _, payload = raw_request(servers["default"], post_head(str(len(body))), body)
        assert_error(status, payload, 400, "invalid_json")
    nested = {"messages": user("Hi"), "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}
    schema: dict = {}
    inner = schema
    for _ in range(80):
        inner["items"] = {}
        inner = inner["items"]
    nested["response_format"]["json_schema"]["schema"] = schema
    data = json.dumps(nested).encode()
    status, _, payload = raw_request(servers["default"], post_head(str(len(data))), data)
    assert_error(status, payload, 400, "invalid_json")


def wait_for_no_other_connection(srv: Server, timeout: float = 10.0) -> dict[str, float]:
    """Earlier tests' connections are released by their handler threads a moment after the client closes; a
    test that counts connections starts once only the asking one is held (and no probe)."""
    deadline = time.monotonic() + timeout
    while True:
        try:  # refused (503, or reset) while the closed connections are still held
            status, _, text = srv.request("GET", "/metrics")
            metrics = parse_prometheus(text) if status == 200 else {}
        except (OSError, http.client.HTTPException):
            metrics = {}
        quiet = metrics.get("vismmoe_open_connections") == 1 and metrics.get("vismmoe_probe_connections") == 0
        if quiet or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_the_connection_cap(servers: dict[str, Server]) -> None:
    srv = servers["default"]
    before = wait_for_no_other_connection(srv)
    assert before["vismmoe_open_connections"] == 1 and before["vismmoe_open_connections_limit"] == 8
    # --max-connections 8 and so 7 per client: 7 held, the 8th is past the cap and read for a probe (2 s at most)
    idle = [srv.raw_socket() for _ in range(8)]
    try:
        time.sleep(0.3)
        status, _, payload = raw_request(srv, post_head("2"), b"{}")
        assert_error(status, payload, 503, "too_many_connections")
        status, _, payload = raw_request(srv, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert status == 200 and payload["status"] == "ok"  # a probe is answered even at the cap (issue 22)
        status, _, text = raw_request(srv, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        at_cap = parse_prometheus(text.decode())
        assert status == 200 and at_cap["vismmoe_open_connections"] == 7
        assert at_cap["vismmoe_probe_connections"] == 1  # the idle 8th (this probe freed its slot once read)
        idle.append(srv.raw_socket())  # a 9th takes this client's second probe slot
        time.sleep(0.3)
        extra = srv.raw_socket()  # and a 10th is refused unread, and counted
        try:
            status = http.client.HTTPResponse(extra)
            status.begin()
            assert status.status == 503
        finally:
            extra.close()
    finally:
        for sock in idle:
            sock.close()
    after = wait_for_no_other_connection(srv)
    assert after["vismmoe_open_connections"] == 1 and after["vismmoe_probe_connections"] == 0
    assert after["vismmoe_connections_refused_total"] >= before["vismmoe_connections_refused_total"] + 1
    assert raw_request(srv, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")[0] == 200


# ---- big inputs -----------------------------------------------------------------------------------------


def test_oversized_images_are_refused_from_their_headers_before_admission(servers: dict[str, Server]) -> None:
    """8 data-URL PNGs of 4096x4096 (a small body): refused at once from the headers, nothing decoded."""
    srv = servers["default"]
    url = "data:image/png;base64," + base64.b64encode(png_bytes(4096, 4096)).decode()
    rss_before = srv.metrics()["process_resident_memory_bytes"]
    start = time.monotonic()
    status, body = srv.chat({"messages": user("Describe.", *[url] * 8), "max_tokens": 2})
    seconds = time.monotonic() - start
    assert_error(status, body, 400, "image_too_large")  # 8 x 64 MiB decoded, planned 1.2 GiB > 512 MiB
    assert "decoded" in body["error"]["message"] and seconds < 5
    rss_after = srv.metrics()["process_resident_memory_bytes"]
    assert rss_after - rss_before < 64 << 20  # nothing was decoded (one image alone is 48 MiB)
    wide = "data:image/png;base64," + base64.b64encode(png_bytes(5000, 4000)).decode()
    assert_error(*srv.chat({"messages": user("Describe.", wide)}), 400, "image_too_large")  # pixels, per image
    assert srv.metrics()["vismmoe_requests_in_flight"] == 0


def test_pending_bytes_are_bounded(tmp_path: Path) -> None:
    srv = start(tmp_path, "--max-pending-bytes", "1MiB", "--max-body-bytes", "2MiB")
    try:
        srv.wait_ready()
        status, _, payload = raw_request(srv, post_head(str(1536 * 1024)), b"")
        assert_error(status, payload, 503, "server_busy")
        assert srv.chat({"messages": user("Hi"), "max_tokens": 2})[0] == 200
    finally:
        srv.stop()


def test_dot_files_and_sockets_outside_stay_unopened(servers: dict[str, Server], tmp_path: Path) -> None:
    """A Unix socket outside the directory: never connected to (the old daemon stat()ed and opened paths)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "trap.sock"))
    listener.listen(1)
    listener.settimeout(0.5)
    try:
        status, body = servers["dirs"].chat({"messages": user("Hi", str(tmp_path / "trap.sock")), "max_tokens": 2})
        assert_error(status, body, 400, "image_unavailable")
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
