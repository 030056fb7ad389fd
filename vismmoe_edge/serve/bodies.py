"""Request bodies: framing (Content-Length, chunked) checked strictly, sizes bounded before they are read.

Every body is bounded twice: by --max-body-bytes per request, and by --max-pending-bytes over all requests
held at once (read, queued or generating), so that a burst of large requests is refused up front instead of
filling memory. A body is either Content-Length framed (exactly one header, decimal digits only) or chunked
(and then bounded chunk by chunk); anything else is refused, which also closes the request-smuggling doors
(both headers at once, negative or repeated lengths).
"""

from __future__ import annotations

import re
import threading
from typing import IO, TYPE_CHECKING

from vismmoe_edge.serve.protocol import ApiError, bad_request, busy, http_error

if TYPE_CHECKING:
    from email.message import Message

DIGITS = re.compile(r"[0-9]{1,19}")
CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,16}")
MAX_CHUNK_LINE = 1024
MAX_TRAILER_LINES = 32


class ByteBudget:
    """Bytes that requests may hold at once; a request that does not fit is refused (never queued)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            if self.used + n > self.capacity:
                raise busy(
                    f"the server holds {self.used} bytes of requests already and this one needs {n} more "
                    f"(--max-pending-bytes {self.capacity}); retry shortly",
                    "server_busy",
                )
            self.used += n

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


def content_length(headers: Message) -> int | None:
    """The body length, or None for a chunked body. 400 for anything malformed or ambiguous."""
    lengths = headers.get_all("Content-Length") or []
    codings = [c.strip().lower() for v in headers.get_all("Transfer-Encoding") or [] for c in v.split(",")]
    if codings:
        if lengths:
            raise bad_request("a request may not have both Transfer-Encoding and Content-Length", code="bad_framing")
        if codings != ["chunked"]:
            raise http_error(501, f"Transfer-Encoding {', '.join(codings)!r} is not supported: use chunked")
        return None
    if not lengths:
        raise http_error(411, "a Content-Length header (or Transfer-Encoding: chunked) is required")
    if len(lengths) > 1:
        raise bad_request("the request has more than one Content-Length header", code="bad_framing")
    if not DIGITS.fullmatch(lengths[0].strip()):
        raise bad_request(f"Content-Length {lengths[0][:30]!r} is not a non-negative integer", code="bad_framing")
    return int(lengths[0])


def too_large(n: int | str, limit: int) -> ApiError:
    return http_error(413, f"the request body has {n} bytes, more than the limit of {limit}")


def read_body(rfile: IO[bytes], headers: Message, limit: int, budget: ByteBudget) -> tuple[bytes, int]:
    """(body, bytes taken from `budget`); the caller gives them back when the request is done. On every other
    way out (a refusal, a timeout: 408, a client that leaves, a bug) the bytes are given back here."""
    length = content_length(headers)
    held = [0]  # bytes taken so far, read by the finally below whatever happened
    done = False
    try:
        try:
            if length is None:
                data = read_chunked(rfile, limit, budget, held)
            else:
                data = read_sized(rfile, length, limit, budget, held)
        except TimeoutError:  # DeadlinePassed (--body-timeout) or the socket's own timeout
            raise http_error(408, "the request body did not arrive in time; the connection is closed") from None
        except OSError:  # reset by the client
            raise bad_request("the connection failed while the body was read", code="bad_framing") from None
        done = True
        return data, held[0]
    finally:
        if not done:
            budget.give(held[0])


def read_sized(rfile: IO[bytes], length: int, limit: int, budget: ByteBudget, held: list[int]) -> bytes:
    if length > limit:
        raise too_large(length, limit)
    budget.take(length)
    held[0] = length
    data = rfile.read(length)
    if len(data) < length:
        raise bad_request("the request body ended early")
    return data


def read_chunked(rfile: IO[bytes], limit: int, budget: ByteBudget, held: list[int]) -> bytes:
    """A chunked body, bounded as it arrives; its budget is taken chunk by chunk (counted in `held`)."""
    parts: list[bytes] = []
    while True:
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if not line.endswith(b"\n"):
            raise bad_request("malformed chunk-size line", code="bad_framing")
        size_text = line.split(b";", 1)[0].strip()
        if not CHUNK_SIZE.fullmatch(size_text):
            raise bad_request("malformed chunk size", code="bad_framing")
        size = int(size_text, 16)
        if size == 0:
            break
        if held[0] + size > limit:
            raise too_large(f"more than {held[0] + size}", limit)
        budget.take(size)
        held[0] += size
        data = rfile.read(size)
        if len(data) < size or rfile.read(2) != b"\r\n":
            raise bad_request("the chunked body ended early or is malformed", code="bad_framing")
        parts.append(data)
    for _ in range(MAX_TRAILER_LINES):
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if line in (b"\r\n", b"\n", b""):
            break
    else:
        raise http_error(431, "too many trailer lines after the chunked body")
    return b"".join(parts)
