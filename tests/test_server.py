"""`vismmoe-edge serve` over real HTTP: a server subprocess with the demo model, on TCP and on a Unix socket."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_support import (
    JSON_HEADER,
    LONG,
    REPO,
    NotifyListener,
    Server,
    assert_error,
    data_url,
    health,
    iter_sse,
    open_stream,
    parse_prometheus,
    random_demo_model,
    start_raw_stream,
    user,
    wait_until,
)

from vismmoe_edge.serve.worker import StopMatcher

# ---- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def notify_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotifyListener]:
    listener = NotifyListener(str(tmp_path_factory.mktemp("notify") / "n.sock"))
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, notify_a: NotifyListener, images: list[Path], big_images: dict[str, Path]
) -> Iterator[Server]:
    """The shared TCP server: small limits so that each one is easy to cross; local images from two directories."""
    root = tmp_path_factory.mktemp("server")
    args = ["--model", str(random_demo_model())]
    args += ["--image-dir", str(images[0].parent), "--image-dir", str(big_images["bytes"].parent)]
    args += ["--port", "0", "--max-queue", "2", "--max-tokens", str(LONG), "--max-prompt-tokens", "300"]
    args += ["--max-image-bytes", "100KiB", "--max-image-pixels", "1000000", "--max-body-bytes", "1MiB"]
    args += ["--request-timeout", "60", "--drain-timeout", "5", "--profile", "auto"]
    srv = Server(args, root / "server.log", {"NOTIFY_SOCKET": notify_a.address, "WATCHDOG_USEC": "1000000"})
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def big_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    root = tmp_path_factory.mktemp("big")
    rng = random.Random(0)
    noise = Image.frombytes("RGB", (200, 200), bytes(rng.getrandbits(8) for _ in range(200 * 200 * 3)))
    noise.save(root / "noise.png")  # ~120 KB: over 100 KiB
    Image.new("RGB", (1200, 1000), (10, 200, 10)).save(root / "wide.png")  # tiny file, 1.2 M pixels
    return {"bytes": root / "noise.png", "pixels": root / "wide.png"}


# ---- unit: stop strings -------------------------------------------------------------------------------


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["END", "xyz"])
    assert m.push("hello E") == ("hello ", False)  # "E" may start "END"
    assert m.push("N") == ("", False)
    assert m.push("Dgone") == ("", True)
    m = StopMatcher(["END"])
    assert m.push("ab EN") == ("ab ", False)
    assert m.push("x") == ("ENx", False)
    assert m.flush() == ""
    assert StopMatcher([]).push("abc") == ("abc", False)


def test_sdnotify_outside_systemd_and_the_watchdog_interval(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vismmoe_edge.serve import sdnotify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready("x") is False and sdnotify.watchdog() is False  # not under systemd: no-ops
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sdnotify.status("x") is False  # a dead socket is logged, never raised
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval() is None  # meant for another process
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() is None


# ---- the TCP server -----------------------------------------------------------------------------------


def test_systemd_notifications(server: Server, notify_a: NotifyListener) -> None:
    lines = notify_a.lines()
    extend = [i for i, line in enumerate(lines) if line.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extend and "READY=1" in lines and extend[0] < lines.index("READY=1"), lines
    assert notify_a.wait_for("WATCHDOG=1", timeout=3), lines
    assert any(line.startswith("STATUS=serving") for line in notify_a.lines())


def test_health_and_models(server: Server) -> None:
    status, _, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "demo-random-v1"
    status, _, models = server.request("GET", "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["demo-random-v1"]
    assert server.request("GET", "/v1/models/demo-random-v1")[0] == 200
    status, _, body = server.request("GET", "/nowhere")
    assert_error(status, body, 404)


def test_chat_with_images_as_path_file_url_and_data_url(server: Server, images: list[Path]) -> None:
    urls = [str(images[0]), images[0].as_uri(), data_url(images[0])]
    answers = []
    for url in urls:
        status, body = server.chat({"messages": user("Describe the image.", url), "max_tokens": 6})
        assert status == 200, body
        assert body["object"] == "chat.completion" and body["model"] == "demo-random-v1"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 1 <= usage["completion_tokens"] <= 6
        answers.append((choice["message"]["content"], usage["prompt_tokens"]))
    assert answers[0] == answers[1] == answers[2]  # the same image three ways, greedy decoding
    status, text_only = server.chat({"messages": user("Describe the image."), "max_tokens": 6})
    assert status == 200 and text_only["usage"]["prompt_tokens"] < answers[0][1]  # images add visual tokens


def test_streaming_matches_non_streaming(server: Server, images: list[Path]) -> None:
    body = {
        "model": "demo-random-v1",
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, *user("Hello", str(images[1]))],
        "max_tokens": 12,
    }
    status, whole = server.chat(body)
    assert status == 200
    conn, resp = open_stream(server, {**body, "stream_options": {"include_usage": True}})
    events = list(iter_sse(resp))
    conn.close()
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


def test_stop_string_cuts_the_reply(server: Server) -> None:
    body = {"messages": user("Hello world"), "max_tokens": 24, "min_tokens": 24}
    status, whole = server.chat(body)
    text = whole["choices"][0]["message"]["content"]
    if len(text) < 4:
        pytest.skip(f"the demo model's reply {text!r} is too short to cut")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    status, cut = server.chat({**body, "stop": [stop]})
    assert status == 200
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_two_concurrent_clients(server: Server, images: list[Path]) -> None:
    body = {"messages": user("What is in this picture?", data_url(images[0])), "max_tokens": 8}
    results: list[tuple[int, Any]] = []
    threads = [threading.Thread(target=lambda: results.append(server.chat(body))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [status for status, _ in results] == [200, 200]
    assert results[0][1]["choices"][0]["message"] == results[1][1]["choices"][0]["message"]
    assert results[0][1]["id"] != results[1][1]["id"]


def test_limits_and_bad_requests_give_openai_errors(
    server: Server, images: list[Path], big_images: dict[str, Path]
) -> None:
    ok = user("Hi")
    assert_error(*server.chat({"messages": user("Hi", str(big_images["bytes"]))}), 400, "image_unavailable")
    assert_error(*server.chat({"messages": user("Hi", data_url(big_images["bytes"]))}), 400, "image_too_large")
    assert_error(*server.chat({"messages": user("Hi", str(big_images["pixels"]))}), 400, "image_too_large")
    assert_error(*server.chat({"messages": user("Hi", "/no/such/image.png")}), 400, "image_unavailable")
    assert_error(*server.chat({"messages": user("Hi", "https://example.com/a.png")}), 400)
    assert_error(*server.chat({"messages": user("word " * 400)}), 400, "context_length_exceeded")
    status, body = server.chat({"messages": ok, "max_tokens": LONG + 1})
    assert_error(status, body, 400)
    assert body["error"]["param"] == "max_tokens"
    assert_error(*server.chat({"messages": ok, "model": "gpt-4o"}), 404, "model_not_found")
    assert_error(*server.chat({"messages": [{"role": "tool", "content": "x"}]}), 400)
    assert_error(*server.chat({"messages": []}), 400)
    assert_error(*server.chat({"messages": ok, "temperature": -1}), 400)
    status, _, body = server.request("POST", "/v1/chat/completions", b'{"messages": [')
    assert_error(status, body, 400, "invalid_json")
    # 413 is decided on Content-Length alone, before a byte of the body is read
    sock = server.raw_socket()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2000000\r\n\r\n"
    )
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    assert_error(resp.status, json.loads(resp.read()), 413)
    sock.close()
    assert server.chat({"messages": ok, "max_tokens": 2})[0] == 200  # still serving


def test_client_disconnect_cancels_generation(server: Server) -> None:
    before = server.metrics()
    long = {"messages": user("Hello"), "max_tokens": LONG, "min_tokens": LONG}
    sock = start_raw_stream(server, long)
    sock.close()
    key = 'vismmoe_requests_cancelled_total{reason="client_disconnect"}'
    assert wait_until(lambda: server.metrics()[key] == before[key] + 1, timeout=10), server.log()
    # a non-streaming client that hangs up while it waits
    sock = server.raw_socket()
    data = json.dumps(long).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\n{JSON_HEADER}Content-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    assert wait_until(lambda: server.metrics()["vismmoe_requests_in_flight"] == 1, timeout=10)
    sock.close()
    assert wait_until(lambda: server.metrics()[key] == before[key] + 2, timeout=10), server.log()
    assert server.metrics()['vismmoe_requests_total{status="499"}'] >= 1
    assert wait_until(lambda: server.metrics()["vismmoe_requests_in_flight"] == 0, timeout=5)
    after = server.metrics()
    assert after["vismmoe_generated_tokens_total"] - before["vismmoe_generated_tokens_total"] < LONG
    assert server.chat({"messages": user("Hi"), "max_tokens": 2})[0] == 200


def test_full_queue_answers_429(server: Server) -> None:
    running = start_raw_stream(server, {"messages": user("Hello"), "max_tokens": LONG, "min_tokens": LONG})
    queued: list[tuple[int, Any]] = []
    waiters = [
        threading.Thread(target=lambda: queued.append(server.chat({"messages": user("Hi"), "max_tokens": 3})))
        for _ in range(2)
    ]
    for waiter in waiters:
        waiter.start()
    assert wait_until(lambda: server.metrics()["vismmoe_queue_depth"] == 2, timeout=10)
    status, headers, body = server.request("POST", "/v1/chat/completions", {"messages": user("Hi")})
    assert_error(status, body, 429, "queue_full")
    assert int(headers["Retry-After"]) >= 1
    running.close()  # cancels the long generation, so the queued requests run
    for waiter in waiters:
        waiter.join(timeout=30)
    assert [status for status, _ in queued] == [200, 200]
    assert server.metrics()['vismmoe_requests_total{status="429"}'] >= 1


def test_metrics_are_prometheus_text(server: Server) -> None:
    assert server.chat({"messages": user("Hi"), "max_tokens": 4})[0] == 200
    status, headers, text = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    m = parse_prometheus(text)
    for name in (
        "vismmoe_up",
        "vismmoe_generated_tokens_total",
        "vismmoe_decode_tokens_per_second",
        "vismmoe_expert_hits_total",
        "vismmoe_expert_misses_total",
        "vismmoe_expert_hit_rate",
        "vismmoe_expert_bytes_read_total",
        "vismmoe_expert_stall_seconds_total",
        "vismmoe_expert_resident_bytes",
        "vismmoe_queue_depth",
        "process_resident_memory_bytes",
    ):
        assert name in m, name
    assert m["vismmoe_up"] == 1 and m['vismmoe_requests_total{status="200"}'] >= 1
    assert m["vismmoe_generated_tokens_total"] >= 4 and m["vismmoe_decode_tokens_per_second"] > 0
    assert m["vismmoe_expert_hits_total"] + m["vismmoe_expert_misses_total"] > 0
    assert 0 <= m["vismmoe_expert_hit_rate"] <= 1 and m["process_resident_memory_bytes"] > 0
    assert "# TYPE vismmoe_expert_bytes_read_total counter" in text


def test_sighup_replans_from_the_profile(server: Server, notify_a: NotifyListener) -> None:
    server.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: server.metrics()["vismmoe_profile_reloads_total"] == 1, timeout=10), server.log()
    assert "profile reloaded" in server.log()
    assert server.request("GET", "/health")[2]["profile"] == "cpu"  # no Jetson, no CUDA here
    assert notify_a.wait_for("RELOADING=1")
    assert server.chat({"messages": user("Hi"), "max_tokens": 2})[0] == 200


def test_official_openai_client(server: Server, images: list[Path]) -> None:
    try:
        import openai
    except ImportError:
        pytest.skip("the openai package is not installed")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["demo-random-v1"]
    messages = user("Describe the image.", data_url(images[0]))
    reply = client.chat.completions.create(model="demo-random-v1", messages=messages, max_tokens=5)
    streamed = client.chat.completions.create(model="demo-random-v1", messages=messages, max_tokens=5, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == reply.choices[0].message.content and reply.usage.completion_tokens >= 1


# ---- the Unix-socket server: deadlines and SIGTERM ------------------------------------------------------


def test_unix_socket_deadline_and_sigterm(tmp_path: Path) -> None:
    notify = NotifyListener(f"@vismmoe-test-{uuid.uuid4().hex}")  # the abstract namespace
    path = tmp_path / "s.sock"
    args = ["--model", str(random_demo_model()), "--listen", f"unix:{path}", "--max-new-tokens", str(LONG)]
    args += ["--request-timeout", "3"]
    args += ["--drain-timeout", "1", "--memory-budget", "100%", "--pinned-layers", "0", "--tier", "host"]
    srv = Server(args, tmp_path / "server.log", {"NOTIFY_SOCKET": notify.address}, unix_socket=path)
    try:
        # it listens before it loads (torch alone takes seconds to import): "loading", and 503 to work
        assert wait_until(lambda: "listening on unix:" in srv.log(), timeout=30), srv.log()
        assert health(srv) == (503, "loading")  # not ready: load balancers and probes wait
        assert_error(*srv.chat({"messages": user("Hi")}), 503, "loading")
        srv.wait_ready()
        assert notify.wait_for("READY=1")
        assert health(srv) == (200, "ok")
        assert srv.chat({"messages": user("Hi"), "max_tokens": 3})[0] == 200

        # a refusal before the body (here a wrong Content-Type) still takes the body the client sends after it:
        # closing with it unread broke the client's pipe (http.client writes head and body apart), and a 503
        # while draining came back as BrokenPipeError
        sock = srv.raw_socket()
        body = json.dumps({"messages": user("Hi")}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        time.sleep(0.3)  # the 415 is written by now
        sock.sendall(body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert_error(resp.status, json.loads(resp.read()), 415)
        sock.close()

        # a request past its deadline returns what it has, as "length"
        start = time.monotonic()
        status, body = srv.chat({"messages": user("Hello"), "max_tokens": LONG, "min_tokens": LONG})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert 1 <= body["usage"]["completion_tokens"] < LONG and time.monotonic() - start < 10
        assert srv.metrics()['vismmoe_requests_cancelled_total{reason="deadline"}'] == 1

        # SIGTERM mid-generation: refuse new work, cancel after --drain-timeout, exit 0
        conn, resp = open_stream(srv, {"messages": user("Hello"), "max_tokens": LONG, "min_tokens": LONG})
        events = iter_sse(resp)
        while "content" not in next(events)["choices"][0]["delta"]:
            pass  # wait for the first generated token
        queued: list[tuple[int, Any]] = []  # a non-streaming request waiting behind it
        waiter = threading.Thread(target=lambda: queued.append(srv.chat({"messages": user("Hi"), "max_tokens": 2})))
        waiter.start()
        assert wait_until(lambda: srv.metrics()["vismmoe_queue_depth"] == 1, timeout=10)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health(srv) == (503, "draining"), timeout=2)
        assert_error(*srv.chat({"messages": user("Hi"), "max_tokens": 2}), 503, "draining")
        rest = list(events)
        conn.close()
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "shutdown"  # an error, not "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in rest[:-2])
        waiter.join(timeout=10)
        assert_error(*queued[0], 503, "shutdown")
        assert srv.proc.wait(timeout=15) == 0
        assert time.monotonic() - start < 1 + 5
        assert not path.exists()
        assert "STOPPING=1" in notify.lines()
    finally:
        srv.stop()
        notify.close()


def test_sigterm_while_loading_and_a_failed_load(tmp_path: Path) -> None:
    """Both in parallel: SIGTERM during the load exits 0; a model that cannot load exits 1 with the reason."""
    loading = Server(["--port", "0"], tmp_path / "a.log", {})
    broken = Server(["--port", "0", "--model", str(tmp_path / "missing")], tmp_path / "b.log", {})
    try:
        assert wait_until(lambda: "loading the model" in loading.log(), timeout=30), loading.log()
        loading.proc.send_signal(signal.SIGTERM)
        assert loading.proc.wait(timeout=15) == 0, loading.log()
        assert "terminated while loading" in loading.log()
        assert broken.proc.wait(timeout=30) == 2, broken.log()  # a configuration error: no restart
        assert "cannot start: " in broken.log() and "missing" in broken.log()
    finally:
        loading.stop()
        broken.stop()


def test_worker_answers_504_to_a_job_past_its_deadline() -> None:
    from types import SimpleNamespace

    from vismmoe_edge.serve.metrics import Metrics
    from vismmoe_edge.serve.protocol import ChatRequest, Limits
    from vismmoe_edge.serve.worker import Job, Worker

    engine = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=64))
    metrics = Metrics()
    worker = Worker(engine, Limits(), metrics)  # type: ignore[arg-type]
    job = Job(ChatRequest(messages=[], images=[], max_tokens=4), time.monotonic() - 1, metrics.record_cancel)
    worker.process(job)
    kind, error = job.events.get_nowait()
    assert kind == "error" and error.status == 504 and error.body()["error"]["code"] == "timeout"
    assert metrics.cancelled["deadline"] == 1


def test_the_worker_sets_torch_threads_in_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon loads on one CPU thread and hands torch's count to the worker (daemon.py: a second OpenMP team
    slowed the worker's parallel ops 1.6-2x). OpenMP's count is each thread's own, so the worker must set it
    from its own thread, before any job."""
    import threading
    from types import SimpleNamespace

    import torch

    from vismmoe_edge.serve.metrics import Metrics
    from vismmoe_edge.serve.protocol import Limits
    from vismmoe_edge.serve.worker import Worker

    count = torch.get_num_threads()  # the count this process already has: nothing changes for later tests
    real = torch.set_num_threads
    seen: list[tuple[str, int]] = []

    def recording(n: int) -> None:
        real(n)
        seen.append((threading.current_thread().name, torch.get_num_threads()))

    monkeypatch.setattr(torch, "set_num_threads", recording)
    engine = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=64))
    worker = Worker(engine, Limits(), Metrics(), threads=count)  # type: ignore[arg-type]
    worker.stop.set()  # the loop sets the count, then sees the stop and returns
    worker.thread.start()
    worker.thread.join(timeout=10)
    assert seen == [("vismmoe-worker", count)]


def test_a_kept_alive_connection_gets_each_reply_without_waiting_for_an_ack(server: Server) -> None:
    """Each reply's body was held back by Nagle's algorithm until the client's delayed ACK of its head: ~40 ms
    on every request after the first on one connection (measured: 44 ms for a /health). The daemon sets
    TCP_NODELAY on its TCP connections."""
    import http.client
    import statistics
    import time

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    walls = []
    try:
        for _ in range(9):
            start = time.perf_counter()
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["status"] == "ok"
            walls.append(time.perf_counter() - start)
    finally:
        conn.close()
    assert statistics.median(walls[1:]) < 0.02, walls  # a stall is >= 40 ms; a /health is ~1 ms


def test_the_worker_gives_freed_memory_back_when_idle_not_between_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """malloc_trim after every job delayed a question sent right after the previous answer; the worker trims once
    it has had no job for TRIM_IDLE_S (or between jobs after TRIM_BUSY_S without a pause)."""
    import time
    from types import SimpleNamespace

    from vismmoe_edge.serve import worker as worker_module
    from vismmoe_edge.serve.metrics import Metrics
    from vismmoe_edge.serve.protocol import Limits
    from vismmoe_edge.serve.worker import TRIM_IDLE_S, Worker

    events: list[tuple[str, float]] = []
    monkeypatch.setattr(worker_module, "release_freed_memory", lambda: events.append(("trim", time.monotonic())))
    monkeypatch.setattr(Worker, "process", lambda self, job: events.append(("job", time.monotonic())))
    engine = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=64))
    worker = Worker(engine, Limits(), Metrics())  # type: ignore[arg-type]
    for _ in range(3):  # queued before the loop starts: back to back
        worker.jobs.put_nowait(SimpleNamespace(request=SimpleNamespace(images=[], videos=[])))
        worker.pending += 1
    worker.thread.start()
    deadline = time.monotonic() + 10
    while not any(kind == "trim" for kind, _ in events) and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop.set()
    worker.thread.join(timeout=10)
    assert [kind for kind, _ in events] == ["job", "job", "job", "trim"]
    assert events[3][1] - events[2][1] >= TRIM_IDLE_S * 0.9  # after a pause, not right after the last job


def test_serve_takes_every_option_the_systemd_unit_passes() -> None:
    import typer
    import typer.main

    from vismmoe_edge.cli.serve import serve_command
    from vismmoe_edge.serve.servers import parse_listen
    from vismmoe_edge.serve.systemd import SERVE_SETTINGS

    app = typer.Typer()
    app.command()(serve_command)
    options = {name for param in typer.main.get_command(app).params for name in param.opts}
    assert {s.flag for s in SERVE_SETTINGS} <= options
    assert parse_listen("unix:/run/vismmoe-edge/api.sock") == ("127.0.0.1", 0, Path("/run/vismmoe-edge/api.sock"))
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080, None)
    assert parse_listen("[::1]:8080") == ("::1", 8080, None)


def test_the_daemon_modules_import_nothing_heavy() -> None:
    modules = ", ".join(f"vismmoe_edge.serve.{m}" for m in ("daemon", "http", "worker", "images", "systemd"))
    code = f"import sys, {modules}; print(sorted(m for m in ('torch', 'transformers', 'PIL') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
