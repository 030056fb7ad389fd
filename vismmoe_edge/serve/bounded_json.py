"""A request body's JSON, bounded before it is parsed: nodes, depth, string and number sizes, top-level fields.

json.loads builds every value it reads: 8 MiB of `[{},{},...]` becomes ~2.8 million dicts (hundreds of MiB), a
31 MiB one took the daemon from 484 to 2,009 MiB. So one pass over the bytes first (a regular expression finds
the tokens in C; the Python loop only sees strings, numbers and punctuation, and stops at the first limit)
counts what json.loads would build and refuses, with a 400, a body that would cost more than a chat request can
need. The limits come from what the body is for (JsonLimits.for_chat): the messages a prompt of
--max-prompt-tokens can hold, the images a request may carry, the logit_bias and stop entries OpenAI allows and
a response_format schema. Top-level fields are checked by name as they are met: an unknown one is refused,
naming it, before anything else is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]

from vismmoe_edge.serve.protocol import MAX_DEPTH, MAX_LOGIT_BIAS, Limits, bad_request

# Punctuation, a string's opening quote, or a number or literal; strings themselves are read by json's own C
# scanner (scanstring), so that escapes and long strings cost C time, not a Python loop or a regex's backtracking.
TOKEN = re.compile(r'[{}\[\],:"]|[^\s{}\[\],:"]+')
MAX_LITERAL_BYTES = 64  # a number or true/false/null; a 4,301-digit integer is a ValueError in json.loads
MAX_SCHEMA_NODES = 20_000  # a response_format schema (constraints.py bounds its compile separately)
NODES_PER_PROMPT_TOKEN = 8  # a message, or a content part, holds at least one token and costs a few nodes
# Top-level fields of a chat-completions body that protocol.py reads, refuses by name, or accepts and ignores.
FIELDS = frozenset(
    """messages model max_tokens max_completion_tokens temperature top_p seed stop stream stream_options min_tokens
    presence_penalty frequency_penalty logit_bias response_format n logprobs top_logprobs tools tool_choice
    functions function_call parallel_tool_calls audio modalities prediction web_search_options user metadata store
    service_tier repetition_penalty top_k best_of guided_json guided_regex guided_grammar prefix_cache""".split()
)


@dataclass(frozen=True)
class JsonLimits:
    max_nodes: int  # values, keys included (a container counts once, and once per comma in it)
    max_string_bytes: int  # one string as sent (escapes included)
    max_depth: int = MAX_DEPTH
    fields: frozenset[str] | None = FIELDS  # allowed top-level keys; None: any

    @classmethod
    def for_chat(cls, limits: Limits, max_text_bytes: int) -> JsonLimits:
        """A chat request's worst case: text up to `max_text_bytes` (the prompt bound), images as data URLs."""
        largest = max(limits.max_image_bytes, limits.max_video_bytes)  # one image or clip file
        data_url = (largest + 2) // 3 * 4 + 64  # its base64 plus "data:...;base64,"
        # A JSON escape such as \u00e9 is 6 bytes for 2 of UTF-8: a text string may be up to 3x its bytes as sent.
        text = 3 * max_text_bytes
        nodes = NODES_PER_PROMPT_TOKEN * limits.max_prompt_tokens + 8 * limits.max_images
        nodes += 2 * limits.max_images * limits.max_video_frames  # video parts' frame URLs
        nodes += 2 * MAX_LOGIT_BIAS + MAX_SCHEMA_NODES + 64
        # Twice the longest useful string: one a little too long gets the specific answer of the check that
        # knows its purpose (image_too_large, context_length_exceeded) instead of this generic one.
        return cls(max_nodes=nodes, max_string_bytes=2 * max(data_url, text, 4096))


def too_big(what: str) -> Exception:
    return bad_request(f"the request body is too large for a chat request: {what}", code="invalid_json")


def check_json_bounds(data: bytes, limits: JsonLimits) -> None:
    """Raise a 400 if parsing `data` would build more than `limits` allow, or if a top-level field is unknown.
    Invalid JSON that passes is left for json.loads to refuse (this only bounds what it would build)."""
    try:
        text = data.decode("utf-8")  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid JSON (not UTF-8)", code="invalid_json") from None
    nodes = depth = pos = 0
    key_next = False  # the next string, at depth 1 of an object, is a top-level key
    stack: list[str] = []  # the open containers
    while (match := TOKEN.search(text, pos)) is not None:
        token = match.group()
        pos = match.end()
        if token == '"':
            try:
                value, pos = scanstring(text, pos)
            except ValueError:
                raise bad_request(
                    "the request body is not valid JSON (a malformed string)", code="invalid_json"
                ) from None
            if pos - match.start() > limits.max_string_bytes:
                raise too_big(f"a string of {pos - match.start()} characters (the limit is {limits.max_string_bytes})")
            nodes += 1
            if key_next and depth == 1 and limits.fields is not None and value not in limits.fields:
                shown = value if len(value) <= 60 else value[:57] + "..."
                raise bad_request(f"unknown field {shown!r} in the request body", shown, "unknown_parameter")
            key_next = False
            del value
        elif token in "{[":
            nodes += 1
            depth += 1
            if depth > limits.max_depth:
                message = f"the request body nests too deeply (more than {limits.max_depth} levels)"
                raise bad_request(message, code="invalid_json")
            stack.append(token)
            key_next = token == "{"
        elif token in "}]":
            if stack:
                stack.pop()
            depth = max(0, depth - 1)
            key_next = False
        elif token == ",":
            nodes += 1
            key_next = bool(stack) and stack[-1] == "{"
        elif token != ":" and len(token) > MAX_LITERAL_BYTES:  # a number or literal
            raise too_big(f"a number or literal of {len(token)} characters (the limit is {MAX_LITERAL_BYTES})")
        if nodes > limits.max_nodes:
            raise too_big(f"more than {limits.max_nodes} JSON values")
