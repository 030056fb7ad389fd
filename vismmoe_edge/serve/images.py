"""`image_url` parts: data URLs and local files, read within the byte and pixel limits, decoded to RGB.

Remote URLs are refused: a robot's daemon fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import stat
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from vismmoe_edge.serve.protocol import Limits, bad_request, image_too_large

if TYPE_CHECKING:
    from PIL import Image


def load_image_url(url: str, param: str, limits: Limits, image_dir: Path | None) -> Image.Image:
    """A data URL, a file:// URL or an absolute path; remote URLs are refused (a robot's daemon fetches nothing)."""
    if url.startswith("data:"):
        return decode_image(decode_data_url(url, param, limits), param, limits)
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"{param}: file URLs must be local (file:///abs/path)", param)
        path = Path(unquote(parsed.path))
    elif url.startswith("/"):
        path = Path(url)
    elif url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not fetched; send a data URL or a local path", param)
    else:
        raise bad_request(f"{param}: use a data:image/...;base64 URL, file:///abs/path or /abs/path", param)
    return decode_image(read_local_image(path, param, limits, image_dir), param, limits)


def decode_data_url(url: str, param: str, limits: Limits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise bad_request(f"{param}: image data URLs must be base64 (data:image/png;base64,...)", param)
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > limits.max_image_bytes + 2:  # reject before decoding
        raise image_too_large(param, f"more than {limits.max_image_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{param}: invalid base64 in the data URL ({e})", param) from None
    if len(data) > limits.max_image_bytes:
        raise image_too_large(param, f"{len(data)} bytes, more than {limits.max_image_bytes}")
    return data


def read_local_image(path: Path, param: str, limits: Limits, image_dir: Path | None) -> bytes:
    if not path.is_absolute():
        raise bad_request(f"{param}: local image paths must be absolute", param)
    if image_dir is not None and not path.resolve().is_relative_to(image_dir):
        raise bad_request(f"{param}: {path} is outside the served image directory {image_dir}", param)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"{param}: {path} is not a regular file", param)
        if info.st_size > limits.max_image_bytes:
            raise image_too_large(param, f"{path} has {info.st_size} bytes, more than {limits.max_image_bytes}")
        with path.open("rb") as f:
            return f.read(limits.max_image_bytes + 1)
    except OSError as e:
        raise bad_request(f"{param}: cannot read {path} ({e.strerror})", param, "image_not_found") from None


def decode_image(data: bytes, param: str, limits: Limits) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > limits.max_image_pixels:  # checked on the header, before decoding
                raise image_too_large(param, f"{img.width}x{img.height}, more than {limits.max_image_pixels} pixels")
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:
        raise bad_request(f"{param}: not an image format PIL can read (PNG, JPEG, WebP, ...)", param) from None
    except Image.DecompressionBombError as e:
        raise image_too_large(param, str(e)) from None
    except (OSError, ValueError) as e:
        raise bad_request(f"{param}: cannot decode the image ({e})", param) from None


