"""The conventions OpenAI clients expect of the daemon (issue 14): errors in OpenAI's shape for every status,
every field type- and range-checked, sampling fields honoured (seed, logit_bias, penalties, response_format),
the streaming usage chunk, /v1/models, and a queue that is fair to clients that retry."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_support import Server, assert_error, iter_sse, open_stream, random_demo_model, user


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("proto")
    args = ["--model", str(random_demo_model()), "--port", "0", "--tier", "host", "--pinned-layers", "0"]
    srv = Server([*args, "--max-tokens", "64"], root / "server.log", {})
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shipped (trained) demo model, as a user runs it: `serve` without --model."""
    root = tmp_path_factory.mktemp("trained")
    srv = Server(["--port", "0"], root / "server.log", {})
    srv.wait_ready()
    yield srv
    srv.stop()


def raw(server: Server, data: bytes) -> tuple[int, dict[str, str], Any]:
    sock = server.raw_socket()
    try:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
        assert resp.getheader("Content-Type") == "application/json", body[:200]
        return resp.status, dict(resp.getheaders()), json.loads(body)
    finally:
        sock.close()


# ---- errors in OpenAI's shape ------------------------------------------------------------------------


def test_every_http_error_is_openai_json(server: Server) -> None:
    cases = [
        (b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\n\r\n", 404),
        (b"GET /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n\r\n", 405),
        (b"DELETE /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", 405),
        (b"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n", 405),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\r\n", 411),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n",
            413,
        ),
        (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
        (b"BREW /health HTTP/1.1\r\nHost: localhost\r\n\r\n", 501),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GARBAGE\r\n\r\n", 400),
    ]
    for request, status in cases:
        got, headers, body = raw(server, request)
        assert_error(got, body, status)
        if status == 405:
            assert "Allow" in headers


# ---- fields ----------------------------------------------------------------------------------------------


BAD_FIELDS = [
    ({"n": True}, "n"),
    ({"n": 2}, "n"),
    ({"n": "1"}, "n"),
    ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stream": "yes"}, "stream"),
    ({"seed": 10**30}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 65}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "a"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_k": 5}, "top_k"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"user": 5}, "user"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS, ids=[json.dumps(f)[:40] for f, _ in BAD_FIELDS])
def test_out_of_range_or_wrongly_typed_fields_are_400(server: Server, fields: dict, param: str | None) -> None:
    status, body = server.chat({"messages": user("Hi"), "max_tokens": 2, **fields})
    assert_error(status, body, 400)
    if param is not None:
        assert body["error"]["param"] == param, body


def test_fields_that_cannot_change_the_reply_are_accepted(server: Server) -> None:
    body = {"messages": user("Hi"), "max_tokens": 2, "user": "robot-7", "metadata": {"a": "b"}, "n": 1}
    body |= {"tool_choice": "none", "parallel_tool_calls": False, "logprobs": False, "store": False}
    assert server.chat(body)[0] == 200


# ---- sampling fields honoured --------------------------------------------------------------------------


def completion_ids(server: Server, body: dict) -> tuple[str, list[int]]:
    status, reply = server.chat({"messages": user("Tell me about shapes."), **body})
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"], reply["vismmoe"]["token_ids"]


def test_seed_makes_sampling_repeatable(server: Server) -> None:
    body = {"max_tokens": 24, "min_tokens": 24, "temperature": 1.5, "top_p": 1.0}
    first = completion_ids(server, {**body, "seed": 7})
    assert completion_ids(server, {**body, "seed": 7}) == first
    assert len(completion_ids(server, {**body, "seed": -(2**63)})[1]) == 24  # the whole int64 range is accepted
    others = {completion_ids(server, {**body, "seed": s})[0] for s in (8, 9, 10)}
    assert others - {first[0]}, "different seeds gave the same replies"


def test_logit_bias_is_honoured(server: Server) -> None:
    _, greedy = completion_ids(server, {"max_tokens": 6, "min_tokens": 6})
    target = (greedy[0] + 1) % 400
    _, ids = completion_ids(server, {"max_tokens": 6, "min_tokens": 6, "logit_bias": {str(target): 100}})
    assert ids == [target] * 6
    _, ids = completion_ids(server, {"max_tokens": 6, "min_tokens": 6, "logit_bias": {str(greedy[0]): -100}})
    assert greedy[0] not in ids


def test_penalties_are_honoured(server: Server) -> None:
    body = {"max_tokens": 40, "min_tokens": 40}
    _, plain = completion_ids(server, body)
    _, frequency = completion_ids(server, {**body, "frequency_penalty": 2.0})
    _, presence = completion_ids(server, {**body, "presence_penalty": 2.0})
    assert len(set(frequency)) > len(set(plain)) and len(set(presence)) > len(set(plain)), (plain, frequency)
    _, negative = completion_ids(server, {**body, "presence_penalty": -2.0})
    assert len(set(negative)) <= len(set(plain))


def test_streaming_usage_chunk_only_when_asked(server: Server) -> None:
    for include in (True, False):
        body = {"messages": user("Hi"), "max_tokens": 4, "stream_options": {"include_usage": include}}
        conn, resp = open_stream(server, body)
        events = list(iter_sse(resp))
        conn.close()
        usage = [e for e in events[:-1] if e.get("usage")]
        assert (len(usage) == 1) is include and events[-1] == "[DONE]"
        if include:
            assert usage[0]["choices"] == [] and usage[0]["usage"]["completion_tokens"] >= 1


def test_models_say_the_model_takes_images(server: Server) -> None:
    status, _, models = server.request("GET", "/v1/models")
    card = models["data"][0]
    assert status == 200 and "image" in card["input_modalities"] and "vision" in card["capabilities"]
    assert card["max_model_len"] > 0


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue", "orange", "purple", "yellow"]},
        "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "shape", "count"],
    "additionalProperties": False,
}


def test_response_format_json_schema_validates_on_the_demo_model(trained: Server, images: list[Path]) -> None:
    import jsonschema
    from serve_support import data_url

    body = {
        "messages": user("What colour is the circle?", data_url(images[0])),
        "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}},
    }
    status, reply = trained.chat(body)
    assert status == 200, reply
    text = reply["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reply["choices"][0]["finish_reason"] == "stop"
    plain = trained.chat({**body, "response_format": {"type": "text"}})[1]["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(plain)  # unconstrained, the demo model answers in words
    status, reply = trained.chat({**body, "response_format": {"type": "json_object"}, "max_tokens": 8})
    assert status == 200 and reply["choices"][0]["message"]["content"].startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}}
    assert_error(*trained.chat({**body, "response_format": bad}), 400)


def test_official_openai_client_with_json_schema_and_usage(trained: Server) -> None:
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{trained.port}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="demo_model",
        messages=user("What shape is it?"),
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model="demo_model", messages=user("Hi"), max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo_model", messages=user("Hi"), n=2)


# ---- the queue: fair to clients that retry ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refused_clients_keep_their_place() -> None:
    """A slot that frees goes to the oldest refused client, not to whoever arrives first."""
    from vismmoe_edge.serve.admission import Admission

    clock = Clock()
    admission = Admission(capacity=2, clock=clock)
    for _ in range(10):
        admission.times.add(2.0)
    assert admission.decide("a", waiting=0, running_elapsed=None) is None
    assert admission.decide("b", waiting=1, running_elapsed=None) is None
    wait_c = admission.decide("c", waiting=2, running_elapsed=0.5)  # full: c gets a ticket
    wait_d = admission.decide("d", waiting=2, running_elapsed=0.5)
    assert wait_c == pytest.approx(0.9 * 1.5) and wait_d == pytest.approx(0.9 * 3.5)  # remaining + a service a slot
    clock.now = 1.6  # a slot frees; a newcomer arrives first
    assert admission.decide("newcomer", waiting=1, running_elapsed=0.0) is not None
    assert admission.decide("d", waiting=1, running_elapsed=0.0) is not None  # not yet d's turn
    assert admission.decide("c", waiting=1, running_elapsed=0.0) is None  # c's turn
    assert admission.decide("d", waiting=2, running_elapsed=0.0) is not None  # that slot went to c
    assert admission.decide("d", waiting=1, running_elapsed=0.0) is None
    assert admission.held == 1  # the newcomer, behind them


def test_a_ticket_whose_client_never_returns_expires() -> None:
    from vismmoe_edge.serve.admission import Admission

    clock = Clock()
    admission = Admission(capacity=1, clock=clock)
    admission.decide("x", waiting=0, running_elapsed=None)
    assert admission.decide("gone", waiting=1, running_elapsed=0.0) is not None
    assert admission.decide("next", waiting=1, running_elapsed=0.0) is not None
    clock.now = 100.0  # far past gone's Retry-After and grace
    assert admission.decide("next", waiting=0, running_elapsed=None) is None


def test_retry_after_is_the_expected_wait(server: Server) -> None:
    """With the queue full behind a long generation, Retry-After grows with the place in line."""
    import threading
    import time

    from serve_support import start_raw_stream, wait_until

    tmp = Path(server.log_path).parent
    srv = Server(
        ["--model", str(random_demo_model()), "--port", "0", "--max-queue", "1", "--tier", "host"],
        tmp / "small-queue.log",
        {},
    )
    try:
        srv.wait_ready()
        for _ in range(3):  # some service times to estimate from
            assert srv.chat({"messages": user("Hi"), "max_tokens": 48, "min_tokens": 48})[0] == 200
        running = start_raw_stream(srv, {"messages": user("Hello"), "max_tokens": 512, "min_tokens": 512})
        waiter = threading.Thread(target=lambda: srv.chat({"messages": user("Hi"), "max_tokens": 2}))
        waiter.start()
        assert wait_until(lambda: srv.metrics()["vismmoe_queue_depth"] == 1, timeout=10)
        waits = []
        for i in range(3):
            status, headers, body = srv.request("POST", "/v1/chat/completions", {"messages": user(f"client {i}")})
            assert_error(status, body, 429, "queue_full")
            waits.append(int(headers["retry-after-ms"]))
            assert int(headers["Retry-After"]) >= 1
        assert waits[0] < waits[1] < waits[2]
        assert srv.metrics()["vismmoe_queue_places_held"] == 3
        running.close()
        waiter.join(timeout=30)
        time.sleep(0.2)
    finally:
        srv.stop()
