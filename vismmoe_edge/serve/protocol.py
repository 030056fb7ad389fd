"""The OpenAI chat-completions protocol: limits, errors in OpenAI's shape, request parsing, response bodies.

Nothing here touches the model or the network: handlers parse with it, the worker reports with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    ImageLoader = Callable[[str, str], Any]  # (url, param) -> an image: the daemon's policy for image_url parts

KiB, MiB = 1024, 1024 * 1024
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4  # as OpenAI


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 * MiB
    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 4096 * 4096
    max_images: int = 8
    max_prompt_tokens: int = 4096
    max_tokens: int = 512  # the cap, and the default when a request names none
    max_queue: int = 8  # requests waiting behind the one generating
    request_timeout_s: float = 300.0  # from arrival, queueing included


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)



def image_too_large(param: str, detail: str) -> ApiError:
    return bad_request(f"{param}: image too large: {detail}", param, "image_too_large")


def unavailable(state: str) -> ApiError:
    message = "the model is still loading" if state == "loading" else "the server is shutting down"
    return ApiError(503, message, type="server_error", code=state, headers={"Retry-After": "5"})


def timeout_error() -> ApiError:
    return ApiError(504, "the request timed out before any token was produced", type="timeout", code="timeout")


def shutdown_error() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutdown")


# ---- request parsing ----------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # the engine's content-list format, {"type": "image"} placeholders
    images: list[Any]  # what the image loader returned, one per {"type": "image"} part
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    min_tokens: int = 0  # vLLM's extension: stop tokens are masked until this many tokens exist


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def parse_number(body: dict, name: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not (lo < value if open_lo else lo <= value) or value > hi:
        interval = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise bad_request(f"'{name}' must be a number in {interval}, got {value!r}", name)
    return float(value)


def parse_stop(value: object) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return [s for s in stops if s]


def parse_chat_request(body: object, limits: Limits, load_image: ImageLoader) -> ChatRequest:
    """Validate an OpenAI chat-completions body (all but 'model') and decode its images."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if body.get("tools") or body.get("functions"):
        raise bad_request("tools and function calling are not supported", "tools")
    if body.get("logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")
    stream = body.get("stream") or False  # null means the default, as for every other field
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = parse_int(body, name, limits.max_tokens, 1, limits.max_tokens)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request(f"'seed' must be an integer, got {seed!r}", "seed")
    messages, images = parse_messages(body.get("messages"), limits, load_image)
    return ChatRequest(
        messages=messages,
        images=images,
        max_tokens=max_tokens,
        temperature=parse_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=parse_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        seed=seed,
        stop=parse_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        min_tokens=parse_int(body, "min_tokens", 0, 0, max_tokens),
    )


def parse_messages(raw: object, limits: Limits, load_image: ImageLoader) -> tuple[list[dict], list[Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    messages: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role = "system" if message.get("role") == "developer" else message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or an array of parts", f"{where}.content")
        parts = [parse_part(p, f"{where}.content[{j}]", images, limits, load_image) for j, p in enumerate(content)]
        messages.append({"role": role, "content": parts})
    return messages, images


def parse_part(part: object, where: str, images: list, limits: Limits, load_image: ImageLoader) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise bad_request(f"{where}.image_url.url must be a string", f"{where}.image_url")
        if len(images) >= limits.max_images:
            raise bad_request(f"at most {limits.max_images} images per request", where, "too_many_images")
        images.append(load_image(url, f"{where}.image_url"))
        return {"type": "image"}
    raise bad_request(f"{where}.type {kind!r} is not supported: use 'text' or 'image_url'", f"{where}.type")



# ---- responses ----------------------------------------------------------------------------------------


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float]
    experts: dict[str, float]


def chunk(reply_id: str, created: int, model: str, delta: dict, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": reply_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
    }


def usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


def completion_body(reply_id: str, created: int, model: str, c: Completion) -> dict[str, Any]:
    message = {"role": "assistant", "content": c.text, "refusal": None}
    return {
        "id": reply_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": c.finish_reason}],
        "usage": usage(c),
        "vismmoe": {"timings": c.timings, "experts": c.experts},  # extra fields: clients ignore them
    }
