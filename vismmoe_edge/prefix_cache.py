"""Prefill reuse across requests: one camera frame, many questions.

Two kinds of entry share one byte bound and one least-recently-used order:

- **vision**: the vision tower's output for one image (its merged visual tokens and DeepStack features), keyed by
  a hash of the decoded image's pixels and of every setting of the processor (resize bounds, patch and merge
  size, normalisation: what shapes the visual tokens), the model, dtype and device (`pixels_key`); inputs built
  without the engine's `encode` are keyed by their processor patches and grid instead (`image_key`);
- **prefix**: the KV cache of a prompt's leading positions. A prompt is compared position by position as its
  *content*: token ids, with every image placeholder replaced by a negative number derived from its image's hash,
  so that two different images of the same size never match. A later request reuses the longest prefix it shares
  with any entry and prefills only the rest (at least its last position, whose logits give the first token).

KV tensors are never written in place once stored (transformers' DynamicCache grows by concatenation, the static
decoder copies), so a reader keeps using tensors another thread evicts; the bound counts what the cache holds.
What is stored (`PrefixCache.store`): a prompt that extends an entry replaces it (a conversation's next turn);
a prompt whose images all lie in the prefix it shares with an entry is not stored (that entry already serves
what it shares: the image and the text before the question); any other prompt is stored whole.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_REUSE_TOKENS = 16  # a shorter shared prefix (a chat template's opening) is not worth a lookup or an entry
MAX_FRAMES = 1024  # encoded images remembered (seen_frames.py): ~0.2 KB each, outside the byte bound


@dataclass(frozen=True)
class CachedVision:
    embeds: torch.Tensor  # [tokens, H] one image's merged visual tokens
    deepstack: tuple[torch.Tensor, ...]  # one [tokens, H] per DeepStack layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


@dataclass(frozen=True)
class CachedPrefix:
    content: torch.Tensor  # [N] int64 on the CPU: token ids, image placeholders replaced by their image's code
    keys: tuple[torch.Tensor, ...]  # per decoder layer [1, heads, N, dim]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return int(self.content.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values)) + self.content.numel() * 8


def restore_prefix(
    cache: DynamicCache, keys_per_layer: Sequence[torch.Tensor], values_per_layer: Sequence[torch.Tensor], reused: int
) -> None:
    """The first `reused` positions of each layer's stored KV as that layer's cache, as views: no copy. A layer's
    next update concatenates into a new tensor and stored KV is never written in place, so what is stored stays
    as it was; `match` leaves at least one position to prefill, so every layer is updated before it is read."""
    for i in range(len(keys_per_layer)):
        keys, values = keys_per_layer[i][:, :, :reused], values_per_layer[i][:, :, :reused]
        layer = cache.layers[i] if i < len(cache.layers) else None
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        else:  # another layer kind (sliding window, ...), or a cache built without a config: its own update
            cache.update(keys, values, i)


@dataclass
class CacheStats:
    vision_hits: int = 0
    vision_misses: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    too_large: int = 0  # entries larger than the whole bound, never stored
    frame_hits: int = 0  # images taken by their encoded bytes: neither decoded nor processed (seen_frames.py)
    bytes: int = 0
    entries: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def image_key(pixel_patches: torch.Tensor, grid_thw: torch.Tensor, salt: str) -> str:
    """The content address of one image: its processor patches (bytes), its grid, and the model/dtype salt."""
    h = hashlib.blake2b(digest_size=16)
    h.update(salt.encode())
    h.update(repr(tuple(int(v) for v in grid_thw.tolist())).encode())
    h.update(str(pixel_patches.dtype).encode())
    h.update(pixel_patches.detach().to("cpu").contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def processor_settings(processor: object) -> str:
    """Every setting of the processor's image processor (resize bounds, patch and merge size, normalisation,
    resampling), as one canonical string: two processors that could turn one image into different visual tokens
    never give the same string."""
    image_processor = getattr(processor, "image_processor", processor)
    to_dict = getattr(image_processor, "to_dict", None)
    settings = to_dict() if callable(to_dict) else vars(image_processor)
    return json.dumps(settings, sort_keys=True, default=repr)


def pixels_key(image: Image.Image, salt: str) -> str:
    """The content address of one decoded image: its mode, size and pixels, and the salt (the model, dtype,
    device and processor settings); the processor is deterministic, so equal keys give equal patches."""
    h = hashlib.blake2b(digest_size=16)
    h.update(salt.encode())
    h.update(f"{image.mode} {image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def image_code(key: str) -> int:
    """A negative int64 standing for the image in a prompt's content (token ids are never negative)."""
    return -1 - (int(key[:15], 16))


def shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading positions two content sequences have in common."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


@dataclass
class PrefixCache:
    """Vision features and prompt-prefix KV under one byte bound, least recently used first out. Thread-safe."""

    capacity_bytes: int
    salt: str = ""  # the model directory, dtype and device: keys of another model never match
    min_reuse_tokens: int = MIN_REUSE_TOKENS
    _entries: OrderedDict[tuple[str, str], CachedVision | CachedPrefix] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stats: CacheStats = field(default_factory=CacheStats)
    _serial: int = 0
    _frames: OrderedDict[str, tuple[str, tuple[int, ...]]] = field(default_factory=OrderedDict)

    # ---- reading ---------------------------------------------------------------------------------------
    def vision(self, keys: list[str]) -> list[CachedVision] | None:
        """Every image's features, or None (a miss) if any one is absent: the tower then runs on all of them
        together, as a cold request would, so that the features stay bit-identical."""
        with self._lock:
            found = [self._entries.get(("vision", k)) for k in keys]
            if any(f is None for f in found):
                self._stats.vision_misses += 1
                return None
            for k in keys:
                self._entries.move_to_end(("vision", k))
            self._stats.vision_hits += 1
            return found  # type: ignore[return-value]

    def match(self, content: torch.Tensor) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with `content`, and how many positions of it may be reused (at
        most all but the last, whose logits the request needs); (None, 0) when none shares MIN_REUSE_TOKENS."""
        with self._lock:
            best, best_len = None, 0
            for key, entry in self._entries.items():
                if key[0] == "prefix":
                    n = shared_length(entry.content, content)  # type: ignore[union-attr]
                    if n > best_len:
                        best, best_len = (key, entry), n
            reuse = min(best_len, content.numel() - 1)
            if best is None or reuse < self.min_reuse_tokens:
                self._stats.prefix_misses += 1
                return None, 0
            self._entries.move_to_end(best[0])
            self._stats.prefix_hits += 1
            self._stats.reused_tokens += reuse
            return best[1], reuse  # type: ignore[return-value]

    def frame(self, frame_key: str) -> tuple[str, tuple[int, ...]] | None:
        """(pixels key, grid) of an image seen by its encoded bytes, while its vision features are held."""
        with self._lock:
            seen = self._frames.get(frame_key)
            if seen is None or ("vision", seen[0]) not in self._entries:
                return None
            self._frames.move_to_end(frame_key)
            return seen

    def count_seen_frames(self, n: int) -> None:
        """`n` images were taken by their bytes (counted only once a request's prompt is built from them)."""
        with self._lock:
            self._stats.frame_hits += n

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._stats.as_dict())

    # ---- writing ---------------------------------------------------------------------------------------
    def put_vision(self, key: str, features: CachedVision) -> None:
        with self._lock:
            self._put(("vision", key), features)

    def store(self, content: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep a prefilled prompt's KV (see the module docstring for which prompts are kept)."""
        image_rows = (content < 0).nonzero()
        last_image = int(image_rows[-1]) + 1 if image_rows.numel() else 0
        with self._lock:
            for key, entry in list(self._entries.items()):
                if key[0] != "prefix":
                    continue
                n = shared_length(entry.content, content)  # type: ignore[union-attr]
                if n == entry.length == content.numel():  # the same prompt again
                    self._entries.move_to_end(key)
                    return
                if n == entry.length:  # this prompt extends the entry: it serves all the entry did, and more
                    self._remove(key)
                elif n >= max(last_image, self.min_reuse_tokens):  # the entry already holds what this one shares
                    return
            self._serial += 1
            entry = CachedPrefix(content.clone(), tuple(keys), tuple(values))
            self._put(("prefix", str(self._serial)), entry)

    def remember_frame(self, frame_key: str, pixels_key: str, grid: tuple[int, ...]) -> None:
        with self._lock:
            self._frames[frame_key] = (pixels_key, grid)
            self._frames.move_to_end(frame_key)
            while len(self._frames) > MAX_FRAMES:
                self._frames.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._frames.clear()
            self._entries.clear()
            self._stats.bytes = self._stats.entries = 0

    def _put(self, key: tuple[str, str], item: CachedVision | CachedPrefix) -> None:
        size = item.nbytes
        if size > self.capacity_bytes:
            self._stats.too_large += 1
            return
        if key in self._entries:
            self._remove(key)
        while self._stats.bytes + size > self.capacity_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self._stats.evictions += 1
        self._entries[key] = item
        self._stats.bytes += size
        self._stats.entries += 1
        self._stats.capacity_bytes = self.capacity_bytes

    def _remove(self, key: tuple[str, str]) -> None:
        item = self._entries.pop(key)
        self._stats.bytes -= item.nbytes
        self._stats.entries -= 1

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ValueError("capacity_bytes must not be negative")
        self._stats.capacity_bytes = self.capacity_bytes
