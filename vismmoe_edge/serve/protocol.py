"""The OpenAI chat-completions protocol: limits, errors in OpenAI's shape, request parsing, response bodies.

Nothing here touches the model, the disk or the network: handlers parse with it, the worker reports with it.
Every field a client may send is either honoured (and type- and range-checked: a wrong one is a 400 naming
it), refused with a 400 because we cannot honour it (tools, logprobs, n > 1, audio), or, when it cannot
change the reply (user, metadata, store), accepted and ignored.
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
MAX_LOGIT_BIAS = 1024  # entries
MAX_DEPTH = 64  # JSON nesting of a request body (a schema in response_format included)
INT64 = (-(2**63), 2**63 - 1)
# Below these, sampling is greedy in all but name, and the arithmetic breaks: logits / 1e-300 overflows float32 to
# inf (NaN probabilities), and a top_p that rounds to 0 in float32 drops even the most likely token.
MIN_TEMPERATURE = 1e-6  # below: greedy (temperature 0), the limit as the temperature goes to 0
MIN_TOP_P = 1e-6  # below: 1e-6, which keeps only the most likely token, as any smaller top_p would
# Fields that would change the reply and that we cannot honour: refused, never silently ignored.
UNSUPPORTED = {
    "tools": "tools and function calling are not supported",
    "functions": "tools and function calling are not supported",
    "function_call": "tools and function calling are not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "top_logprobs": "logprobs are not supported",
    "repetition_penalty": "repetition_penalty is not supported: use presence_penalty or frequency_penalty",
    "top_k": "top_k is not supported: use top_p",
    "best_of": "best_of is not supported",
    "guided_json": "use response_format: {'type': 'json_schema', ...}",
    "guided_regex": "regular-expression constraints are not supported",
    "guided_grammar": "grammar constraints are not supported: use response_format",
}


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * MiB
    max_image_bytes: int = 20 * MiB  # one image as sent (compressed)
    max_image_pixels: int = 4096 * 4096  # one image, from its header, before any decode
    max_decoded_bytes: int = 512 * MiB  # a request's images at their peak in the worker (images.planned_peak)
    max_pending_bytes: int = 256 * MiB  # request bodies held at once (read, queued or running)
    max_images: int = 8
    max_video_frames: int = 32  # frames of one clip once sampled, or sent as frames
    max_video_bytes: int = 20 * MiB  # one clip file as sent (compressed)
    video_fps: float = 2.0  # frames sampled a second from a clip file, unless its part says
    video_max_pixels: int = 128 * 32 * 32  # each frame once resized by the processor: 128 tokens per frame pair
    max_prompt_tokens: int = 4096
    max_tokens: int = 512  # the cap, and the default when a request names none
    max_queue: int = 8  # requests waiting behind the one generating
    max_connections: int = 64  # open client connections; more are answered 503 at once
    max_connections_per_client: int = 56  # one client (IP address or uid) cannot take the last 1/8
    header_timeout_s: float = 10.0  # request line and headers, from when the handler waits for them
    body_timeout_s: float = 60.0  # the whole body, from the end of the headers
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


def retry_headers(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (RFC 9110), and retry-after-ms, which the openai clients prefer."""
    seconds = max(0.05, seconds)
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(int(seconds * 1000))}


def unavailable(state: str) -> ApiError:
    message = "the model is still loading" if state == "loading" else "the server is shutting down"
    return ApiError(503, message, type="server_error", code=state, headers=retry_headers(5))


def busy(message: str, code: str, retry_s: float = 1.0) -> ApiError:
    return ApiError(503, message, type="server_error", code=code, headers=retry_headers(retry_s))


def timeout_error() -> ApiError:
    return ApiError(504, "the request timed out before any token was produced", type="timeout", code="timeout")


def shutdown_error() -> ApiError:
    return ApiError(503, "the server shut down before the reply was complete", type="server_error", code="shutdown")


def show(value: object) -> str:
    """A client's value in an error message, cut short: the message must not echo megabytes back."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} or {"type": "json_schema", "schema"}
    videos: list[Any] = field(default_factory=list)  # what the video reader returned, one per {"type": "video"}
    prefix_cache: bool = True  # our extension: false neither reuses nor keeps this request's prefill


def sampling_floor(temperature: float, top_p: float) -> tuple[float, float]:
    """(temperature, top_p) as sampled: tiny values replaced by their limits (shared with `vismmoe-edge run`)."""
    return (0.0 if temperature < MIN_TEMPERATURE else temperature), max(top_p, MIN_TOP_P)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be an integer in [{lo}, {hi}], got {show(value)}", name)
    return value


def parse_number(body: dict, name: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not (lo < value if open_lo else lo <= value) or value > hi:
        interval = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise bad_request(f"'{name}' must be a number in {interval}, got {show(value)}", name)
    return float(value)


def parse_bool(container: dict, name: str, param: str, default: bool) -> bool:
    value = container.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{param}' must be true or false, got {show(value)}", param)
    return value


def parse_object(body: dict, name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, got {show(value)}", name)
    return value


def parse_stop(value: object) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return [check_text(s, "stop") for s in stops if s]


def parse_logit_bias(value: object, vocab_size: int) -> dict[int, float]:
    """{"token id": bias in [-100, 100]}, as OpenAI; ids are checked against this model's vocabulary."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    bias: dict[int, float] = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
            raise bad_request(f"'logit_bias' key {show(key)} is not a token id in [0, {vocab_size})", "logit_bias")
        if not _is_number(number) or not -100 <= number <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {show(number)}", "logit_bias")
        bias[int(key)] = float(number)
    return bias


def parse_response_format(value: object) -> dict[str, Any] | None:
    """None for plain text; else {"type": "json_object"} or {"type": "json_schema", "schema": {...}}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object", "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("'response_format.json_schema.name' must be a string", "response_format.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        param = "response_format.json_schema.schema"
        raise bad_request(f"'{param}' must be a JSON Schema object", param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'response_format.json_schema.strict' must be true or false", "response_format")
    return {"type": "json_schema", "schema": schema}  # strict or not, the schema is enforced token by token


def refuse_unsupported(body: dict) -> None:
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise bad_request(f"'{name}': {why}", name, "unsupported_parameter")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request(f"'n' must be 1 (one choice per request), got {show(n)}", "n", "unsupported_parameter")
    if parse_bool(body, "logprobs", "logprobs", False):
        raise bad_request("logprobs are not supported", "logprobs", "unsupported_parameter")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none"):
        raise bad_request("'tool_choice' must be 'none': no tools here", "tool_choice", "unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("'modalities' must be ['text']", "modalities", "unsupported_parameter")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("'user' must be a string", "user")
    parse_bool(body, "parallel_tool_calls", "parallel_tool_calls", True)


def parse_chat_request(
    body: object, limits: Limits, load_image: ImageLoader, vocab_size: int, videos: Any = None
) -> ChatRequest:
    """Validate an OpenAI chat-completions body (all but 'model'); `load_image` reads each image_url part,
    `videos` (serve/videos.py's VideoReader; None: no video taken) each video_url and video part."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    refuse_unsupported(body)
    stream = parse_bool(body, "stream", "stream", False)  # null means the default, as for every other field
    options = parse_object(body, "stream_options")
    if options and not stream:
        raise bad_request("'stream_options' is only allowed with stream: true", "stream_options")
    include_usage = parse_bool(options, "include_usage", "stream_options.include_usage", False)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = parse_int(body, name, limits.max_tokens, 1, limits.max_tokens)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not INT64[0] <= seed <= INT64[1]):
        raise bad_request(f"'seed' must be a 64-bit integer, got {show(seed)}", "seed")
    response_format = parse_response_format(body.get("response_format"))
    min_tokens = parse_int(body, "min_tokens", 0, 0, max_tokens)
    if response_format is not None and min_tokens:
        raise bad_request("'min_tokens' cannot be combined with response_format", "min_tokens")
    temperature, top_p = sampling_floor(
        parse_number(body, "temperature", 0.0, 0.0, 2.0), parse_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True)
    )
    sampling = dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=parse_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        min_tokens=min_tokens,
        presence_penalty=parse_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=parse_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=parse_logit_bias(body.get("logit_bias"), vocab_size),
        response_format=response_format,
        prefix_cache=parse_bool(body, "prefix_cache", "prefix_cache", True),
    )
    media = Media(load_image, videos)
    messages = parse_messages(body.get("messages"), limits, media)  # last: images cost the most
    return ChatRequest(messages=messages, images=media.images, videos=media.videos, **sampling)  # type: ignore[arg-type]


@dataclass
class Media:
    """A request's images and clips as its parts are read, with the readers that take them."""

    load_image: Any
    reader: Any = None  # serve/videos.py's VideoReader
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)


def parse_messages(raw: object, limits: Limits, media: Media) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role = "system" if message.get("role") == "developer" else message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {show(role)}", f"{where}.role")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad_request(f"{where}: tool calls are not supported", f"{where}.tool_calls", "unsupported_parameter")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": check_text(content, f"{where}.content")})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or an array of parts", f"{where}.content")
        parts = [parse_part(p, f"{where}.content[{j}]", limits, media) for j, p in enumerate(content)]
        messages.append({"role": role, "content": parts})
    return messages


def parse_part(part: object, where: str, limits: Limits, media: Media) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": check_text(part["text"], f"{where}.text")}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise bad_request(f"{where}.image_url.url must be a string", f"{where}.image_url")
        detail = spec.get("detail") if isinstance(spec, dict) else None
        if detail not in (None, "auto", "low", "high"):
            raise bad_request(f"{where}.image_url.detail must be auto, low or high", f"{where}.image_url.detail")
        if len(media.images) + len(media.videos) >= limits.max_images:  # a clip counts as an image
            raise bad_request(f"at most {limits.max_images} images per request", where, "too_many_images")
        media.images.append(media.load_image(url, f"{where}.image_url"))
        return {"type": "image"}
    if kind in ("video_url", "video"):
        return parse_video_part(part, kind, where, limits, media)
    raise bad_request(
        f"{where}.type {show(kind)} is not supported: use 'text', 'image_url', 'video_url' or 'video'", f"{where}.type"
    )


def parse_video_part(part: dict, kind: str, where: str, limits: Limits, media: Media) -> dict[str, Any]:
    """`video_url` (a clip file) or `video` (a list of frame image URLs); serve/videos.py reads them."""
    if media.reader is None:
        raise bad_request(f"{where}: this server takes no video input", f"{where}.type", "unsupported_parameter")
    spec = part.get(kind)
    fps = part.get("fps", spec.get("fps") if isinstance(spec, dict) else None)
    if fps is not None and (not _is_number(fps) or not 0 < fps <= 60):
        raise bad_request(f"{where}.fps must be a number in (0, 60], got {show(fps)}", f"{where}.fps")
    if len(media.images) + len(media.videos) >= limits.max_images:
        raise bad_request(f"at most {limits.max_images} images and clips per request", where, "too_many_images")
    if kind == "video_url":
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise bad_request(f"{where}.video_url.url must be a string", f"{where}.video_url")
        media.videos.append(media.reader.from_url(url, fps, f"{where}.video_url"))
    else:
        if not isinstance(spec, list):
            raise bad_request(f"{where}.video must be an array of image URLs (the frames, in order)", f"{where}.video")
        media.videos.append(media.reader.from_frames(spec, fps, f"{where}.video"))
    return {"type": "video"}


def check_text(text: str, param: str) -> str:
    """A string the prompt will hold: a lone surrogate (valid in JSON's \\uXXXX, not in UTF-8) is a 400."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{param} holds a lone UTF-16 surrogate (\\ud800-\\udfff), not text", param) from None
    return text


def prompt_text_bytes(messages: list[dict[str, Any]]) -> int:
    """UTF-8 bytes of the text in parsed messages (their strings were checked by check_text)."""
    total = 0
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            total += len(content.encode())
        else:
            total += sum(len(part["text"].encode()) for part in content if part["type"] == "text")
    return total


# ---- responses ----------------------------------------------------------------------------------------


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float]
    experts: dict[str, float]
    token_ids: list[int] = field(default_factory=list)  # the reply's tokens, stop token included


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
        "vismmoe": {"timings": c.timings, "experts": c.experts, "token_ids": c.token_ids},  # clients ignore extras
    }


STATUS_CODES = {  # status -> (type, code) for errors that the HTTP layer itself answers
    400: ("invalid_request_error", "bad_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    411: ("invalid_request_error", "length_required"),
    413: ("invalid_request_error", "request_too_large"),
    414: ("invalid_request_error", "uri_too_long"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "headers_too_large"),
    501: ("server_error", "not_implemented"),
    505: ("server_error", "http_version_not_supported"),
}


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> ApiError:
    kind, code = STATUS_CODES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return ApiError(status, message, type=kind, code=code, headers=headers)
