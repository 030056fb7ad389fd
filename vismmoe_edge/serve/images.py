"""`image_url` parts: read within the byte limit, checked from their headers, decoded only once admitted.

Handler threads call `load_image_url`: it takes the compressed bytes (a data URL, or a local file under an
--image-dir) and reads only the image header (PIL opens lazily), so pixel, decoded-byte and visual-token budgets
are checked before any pixel is decoded and before the request is queued. The worker decodes (`decode`) when the
request's turn comes, one request at a time.

Local paths are off unless the operator names directories (--image-dir). A path must lie under one of them
lexically and once resolved; it is opened with O_NOFOLLOW, checked with fstat on the opened descriptor and its
/proc/self/fd link checked again, so a symlink or a swapped directory cannot lead outside. Every refusal of a
local path gives the same message, whether the file is missing, outside, a directory, a FIFO, unreadable or too
large: a client learns nothing about files it may not read.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from vismmoe_edge.serve.protocol import Limits, bad_request, image_too_large

if TYPE_CHECKING:
    from collections.abc import Callable

    from PIL import Image

    TokenEstimator = Callable[[int, int], int]  # (width, height) -> visual tokens, from the model's processor

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY  # NONBLOCK: a FIFO never hangs


@dataclass
class PendingImage:
    """An image as received: compressed bytes and what its header says; decoded by the worker."""

    data: bytes
    width: int
    height: int
    mode: str  # PIL's mode once decoded (RGB, RGBA, L, P, ...)
    param: str
    tokens: int = 0  # the processor's visual tokens for this size (0: unknown)

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the decoded image: PIL keeps RGB as 4 bytes a pixel (RGBX), plus the RGB copy when the
        file's mode is another one."""
        pixels = self.width * self.height
        own = pixels * (1 if self.mode in ("1", "L", "P") else 2 if self.mode.startswith("I;16") else 4)
        return own + (pixels * 4 if self.mode != "RGB" else 0)


def local_refusal(param: str) -> Exception:
    """The one answer for every local path that will not be served."""
    return bad_request(
        f"{param}: this local image is not available (local paths are served only for readable image files of at "
        "most --max-image-bytes under the daemon's --image-dir directories)",
        param,
        "image_unavailable",
    )


def load_image_url(
    url: str, param: str, limits: Limits, image_dirs: tuple[str, ...], estimate: TokenEstimator | None = None
) -> PendingImage:
    """A data URL, or (with --image-dir) a file:// URL or an absolute path; remote URLs are refused."""
    if url.startswith("data:"):
        data = decode_data_url(url, param, limits)
    elif url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not fetched; send a data URL", param)
    elif url.startswith(("file:", "/")) or image_dirs:  # with directories served, anything else names a file
        if not image_dirs:
            raise bad_request(
                f"{param}: local image paths are off on this server (its operator can allow directories with "
                "--image-dir); send a data URL",
                param,
                "local_images_disabled",
            )
        data = read_local_image(local_path(url, param), param, limits, image_dirs)
    else:
        raise bad_request(f"{param}: use a data:image/...;base64 URL (or file:///abs/path under --image-dir)", param)
    return inspect_image(data, param, limits, estimate)


def local_path(url: str, param: str) -> str:
    if url.startswith("file:"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
            raise local_refusal(param)
        return unquote(parsed.path)
    return url


def decode_data_url(url: str, param: str, limits: Limits, what: str = "image") -> bytes:
    """A base64 data URL's bytes, at most `limits.max_image_bytes` (`what` names the content in messages)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        example = "data:image/png;base64,..." if what == "image" else f"data:{what}/mp4;base64,..."
        raise bad_request(f"{param}: {what} data URLs must be base64 ({example})", param)
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > limits.max_image_bytes + 2:  # reject before decoding
        raise too_large(param, what, f"more than {limits.max_image_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{param}: invalid base64 in the data URL ({e})", param) from None
    if len(data) > limits.max_image_bytes:
        raise too_large(param, what, f"{len(data)} bytes, more than {limits.max_image_bytes}")
    return data


def too_large(param: str, what: str, detail: str) -> Exception:
    """protocol.image_too_large's answer, for an image or a clip."""
    return bad_request(f"{param}: {what} too large: {detail}", param, "image_too_large")


def under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def read_local_image(path: str, param: str, limits: Limits, image_dirs: tuple[str, ...]) -> bytes:
    """The file's bytes, if it is a regular file within the limit under one of `image_dirs` (resolved paths)."""
    if "\0" in path or not os.path.isabs(path) or not under(os.path.normpath(path), image_dirs):
        raise local_refusal(param)  # decided on the text alone: outside paths are never looked at
    real = os.path.realpath(path)
    if not under(real, image_dirs):
        raise local_refusal(param)  # a symlink inside that leads outside
    try:
        fd = os.open(real, OPEN_FLAGS)
    except OSError:
        raise local_refusal(param) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limits.max_image_bytes:
            raise local_refusal(param)
        opened = opened_path(fd)
        if opened is not None and not under(opened, image_dirs):
            raise local_refusal(param)  # a directory on the way was swapped for a symlink after realpath()
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limits.max_image_bytes + 1)
    except OSError:
        raise local_refusal(param) from None
    finally:
        os.close(fd)
    if len(data) > limits.max_image_bytes:
        raise local_refusal(param)  # grew since fstat
    return data


def opened_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # no /proc: realpath() and O_NOFOLLOW still hold


def inspect_image(data: bytes, param: str, limits: Limits, estimate: TokenEstimator | None) -> PendingImage:
    """Read the header only (PIL decodes lazily) and check the per-image pixel limit."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height, mode = img.width, img.height, img.mode
    except UnidentifiedImageError:
        raise bad_request(f"{param}: not an image format PIL can read (PNG, JPEG, WebP, ...)", param) from None
    except Image.DecompressionBombError as e:
        raise image_too_large(param, str(e)) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise bad_request(f"{param}: cannot read the image header ({e})", param) from None
    if width < 1 or height < 1:
        raise bad_request(f"{param}: the image is empty ({width}x{height})", param)
    if width * height > limits.max_image_pixels:
        raise image_too_large(param, f"{width}x{height}, more than {limits.max_image_pixels} pixels")
    tokens = estimate(width, height) if estimate is not None else 0
    return PendingImage(data, width, height, mode, param, tokens)


def decode(image: PendingImage) -> Image.Image:
    """The RGB image (in the worker, once the request's turn has come)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(image.data)) as img:
            if (img.width, img.height) != (image.width, image.height):
                raise bad_request(f"{image.param}: the image changed size while decoding", image.param)
            img.load()
            return img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise bad_request(f"{image.param}: cannot decode the image ({e})", image.param) from None


# What decoding and the processor really cost, per byte of decoded_bytes and per pixel of the largest image,
# measured with tools/bench/request_peak.py (docs/benchmarks.md, "One request's memory"): the decoded images and
# the processor's uint8 arrays of all of them (<= 2x), and its float32 working copy of one image at a time.
PEAK_PER_DECODED_BYTE = 2
PEAK_PER_LARGEST_PIXEL = 12


def planned_peak(images: list[PendingImage]) -> int:
    """The memory a request's images will take at their peak in the worker, from their headers."""
    if not images:
        return 0
    largest = max(i.width * i.height for i in images)
    return PEAK_PER_DECODED_BYTE * sum(i.decoded_bytes for i in images) + PEAK_PER_LARGEST_PIXEL * largest


def check_request_images(images: list[PendingImage], limits: Limits, max_tokens: int, max_positions: int) -> None:
    """Budgets over all of a request's images, from their headers: before admission, before any decode."""
    peak = planned_peak(images)
    if peak > limits.max_decoded_bytes:
        raise bad_request(
            f"the images would take {peak} bytes at their peak once decoded and processed, more than the limit of "
            f"{limits.max_decoded_bytes} (--max-decoded-bytes); send smaller images",
            "messages",
            "image_too_large",
        )
    tokens = sum(i.tokens for i in images)
    if tokens > limits.max_prompt_tokens:
        raise bad_request(
            f"the images alone make {tokens} visual tokens, more than the limit of {limits.max_prompt_tokens}",
            "messages",
            "context_length_exceeded",
        )
    if max_positions and tokens + max_tokens > max_positions:
        raise bad_request(
            f"the images ({tokens} tokens) + max_tokens ({max_tokens}) exceed the model's {max_positions} positions",
            "max_tokens",
            "context_length_exceeded",
        )
