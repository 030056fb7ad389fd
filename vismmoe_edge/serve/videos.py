"""Video parts: a clip file (`video_url`) or a list of frames (`video`), checked from headers before admission.

Two shapes, as users send them:
- `{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}`: vLLM's and OpenAI-compatible
  servers' part for a clip file. A local path (`file:///abs`, `/abs`) is read as image paths are: only under
  --image-dir (images.read_local_image: same checks, the --max-video-bytes bound).
- `{"type": "video", "video": ["data:image/jpeg;base64,...", ...], "fps": 2}`: frames already picked by the
  sender (Qwen's own API and qwen-vl-utils take this shape), each read as an `image_url` is, `1 / fps` s apart.
Both may carry `"fps"` (default: --video-fps): for a file, the rate frames are sampled at; for frames, their rate.

In the handler thread a file's header is read with PyAV (no frame decoded) and the frames it would keep are
chosen by transformers' video processor; the frame bound (--max-video-frames), the per-frame pixel bound and the
visual tokens (transformers' own count) are checked there, before the request is queued. The worker decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve.images import PendingImage, decode, decode_data_url, local_path, read_local_image
from vismmoe_edge.serve.protocol import Limits, bad_request, image_too_large

if TYPE_CHECKING:
    from vismmoe_edge.video import Clip, VideoHeader

# The worker's peak for a clip, per decoded source pixel and per processed pixel: the kept RGB frames and their
# stacked copy, the processor's channel-first copy (3 bytes a pixel each), then its float32 frames, normalised
# and patchified (4 bytes a channel, three arrays). Measured at 0.70-0.91 of it (tools/bench/request_peak.py
# --video; docs/benchmarks.md, "A clip's memory against its planned peak").
PEAK_PER_SOURCE_PIXEL = 3 * 3
PEAK_PER_PROCESSED_PIXEL = 3 * 4 * 3


@dataclass
class PendingVideo:
    """A clip as received: a file's bytes and header, or frames as images; decoded by the worker."""

    param: str
    fps: float
    width: int
    height: int
    frames: int  # frames the model will see
    tokens: int = 0  # visual tokens (transformers' count for this size and frame count)
    data: bytes | None = None  # a file's bytes
    header: VideoHeader | None = None
    indices: list[int] = field(default_factory=list)  # the file's frames kept
    images: list[PendingImage] = field(default_factory=list)  # or the frames as sent
    frame_pixels: int = 0  # pixels of each frame once the processor has resized it

    @property
    def peak_bytes(self) -> int:
        source = self.frames * self.width * self.height
        own = sum(i.decoded_bytes for i in self.images)
        return own + PEAK_PER_SOURCE_PIXEL * source + PEAK_PER_PROCESSED_PIXEL * self.frames * self.frame_pixels


class VideoReader:
    """What the daemon needs to take video parts: its limits, directories and the model's video processor."""

    def __init__(self, limits: Limits, image_dirs: tuple[str, ...], video_processor: Any, load_image: Any) -> None:
        self.limits = limits
        self.image_dirs = image_dirs
        self.processor = video_processor  # None: the model takes no video
        self.load_image = load_image  # (url, param) -> PendingImage, as for image_url parts

    def settings(self, fps: float | None, param: str) -> Any:
        from vismmoe_edge.video import VideoSettings

        try:
            rate = self.limits.video_fps if fps is None else fps
            return VideoSettings(fps=rate, max_frames=self.limits.max_video_frames)
        except VismmoeError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def check_model(self, param: str) -> None:
        if self.processor is None:
            raise bad_request(f"{param}: this model takes no video input", param, "unsupported_parameter")

    def from_url(self, url: str, fps: float | None, param: str) -> PendingVideo:
        """A `video_url` part: a data URL, or a local path under --image-dir."""
        self.check_model(param)
        settings = self.settings(fps, param)
        if url.startswith("data:"):  # any media type: the container is told from the first bytes
            data = decode_data_url(url, param, self.video_byte_limits(), "video")
        elif url.startswith(("http://", "https://")):
            raise bad_request(f"{param}: remote video URLs are not fetched; send a data URL", param)
        elif url.startswith(("file:", "/")) or self.image_dirs:
            if not self.image_dirs:
                raise bad_request(
                    f"{param}: local paths are off on this server (its operator can allow directories with "
                    "--image-dir); send a data URL",
                    param,
                    "local_images_disabled",
                )
            data = read_local_image(local_path(url, param), param, self.video_byte_limits(), self.image_dirs)
        else:
            raise bad_request(
                f"{param}: use a data:video/mp4;base64 URL (or file:///abs/path under --image-dir)", param
            )
        from vismmoe_edge.video import probe_video, sample_indices

        try:
            header = probe_video(data, param)
            if header.width * header.height > self.limits.max_image_pixels:
                raise image_too_large(
                    param, f"frames of {header.width}x{header.height}, more than {self.limits.max_image_pixels} pixels"
                )
            indices = sample_indices(header, settings, self.processor, param)
        except VismmoeError as e:
            raise bad_request(str(e), param, code_for(str(e))) from None
        video = PendingVideo(param, header.fps, header.width, header.height, len(indices), data=data, header=header)
        video.indices = indices
        return self.count(video)

    def from_frames(self, urls: list[Any], fps: float | None, param: str) -> PendingVideo:
        """A `video` part: image URLs taken as consecutive frames."""
        self.check_model(param)
        settings = self.settings(fps, param)
        if len(urls) > settings.max_frames:
            raise bad_request(
                f"{param}: {len(urls)} frames, more than the limit of {settings.max_frames} (--max-video-frames)",
                param,
                "too_many_frames",
            )
        if len(urls) < 2:
            raise bad_request(f"{param}: a clip needs at least 2 frames; send one frame as an image_url", param)
        images = []
        for j, url in enumerate(urls):
            if not isinstance(url, str):
                raise bad_request(f"{param}[{j}] must be an image URL string", f"{param}[{j}]")
            images.append(self.load_image(url, f"{param}[{j}]"))
        sizes = {(i.width, i.height) for i in images}
        if len(sizes) > 1:
            raise bad_request(f"{param}: the frames differ in size; send frames of one size", param)
        width, height = sizes.pop()
        return self.count(PendingVideo(param, settings.fps, width, height, len(images), images=images))

    def video_byte_limits(self) -> Limits:
        from dataclasses import replace

        return replace(self.limits, max_image_bytes=self.limits.max_video_bytes)

    def count(self, video: PendingVideo) -> PendingVideo:
        """Visual tokens and processed frame size from transformers' own arithmetic (no pixels needed)."""
        proc = self.processor
        try:
            patches = int(proc.get_num_of_video_patches(video.frames, video.height, video.width))
        except ValueError as e:  # an aspect ratio past 200:1, ...
            raise bad_request(f"{video.param}: {e}", video.param) from None
        video.tokens = patches // proc.merge_size**2
        grid_t = math.ceil(video.frames / proc.temporal_patch_size)
        video.frame_pixels = patches // max(grid_t, 1) * proc.patch_size**2
        return video


def code_for(message: str) -> str:
    if "more than the limit" in message:
        return "too_many_frames"
    if "pixels" in message:
        return "image_too_large"
    return "invalid_value"


def decode_video(video: PendingVideo) -> Clip:
    """The clip's frames (in the worker, once the request's turn has come)."""
    from vismmoe_edge.video import VideoSettings, clip_from_images, decode_clip

    try:
        if video.header is not None and video.data is not None:
            return decode_clip(video.data, video.header, video.indices, video.param)
        frames = [decode(image) for image in video.images]
        return clip_from_images(frames, VideoSettings(fps=video.fps, max_frames=len(frames)), video.param)
    except VismmoeError as e:
        raise bad_request(str(e), video.param) from None


def check_request_media(
    images: list[PendingImage], videos: list[PendingVideo], limits: Limits, max_tokens: int, max_positions: int
) -> None:
    """images.check_request_images's budgets over a request's images and clips together."""
    from vismmoe_edge.serve.images import planned_peak

    peak = planned_peak(images) + sum(v.peak_bytes for v in videos)
    if peak > limits.max_decoded_bytes:
        raise bad_request(
            f"the images and videos would take {peak} bytes at their peak once decoded and processed, more than the "
            f"limit of {limits.max_decoded_bytes} (--max-decoded-bytes); send fewer or smaller frames",
            "messages",
            "image_too_large",
        )
    tokens = sum(i.tokens for i in images) + sum(v.tokens for v in videos)
    if tokens > limits.max_prompt_tokens:
        raise bad_request(
            f"the images and videos alone make {tokens} visual tokens, more than the limit of "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens); send fewer frames or a lower fps",
            "messages",
            "context_length_exceeded",
        )
    if max_positions and tokens + max_tokens > max_positions:
        raise bad_request(
            f"the images and videos ({tokens} tokens) + max_tokens ({max_tokens}) exceed the model's "
            f"{max_positions} positions",
            "max_tokens",
            "context_length_exceeded",
        )
