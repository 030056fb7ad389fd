"""Qwen3-VL's video processor, with or without torchvision, attached to a processor loaded without it.

transformers' `Qwen3VLVideoProcessor` samples frames, picks each frame's size, patchifies and says how many
tokens a clip takes; it is a `TorchvisionBackend`, and three of the calls it makes go to torchvision
(`grayscale_to_rgb`, `resize`, `normalize`: transformers' `image_processing_backends.py`). Where torchvision is
installed its own class is used unchanged. Where it is not (JetPack's torch has no matching PyPI torchvision,
docs/platform-facts.md §4.1), `TorchFreeQwen3VLVideoProcessor` replaces those three calls with the plain torch ops
torchvision runs on the CPU for them: a bicubic antialiased `interpolate` of the uint8 frames (torchvision's
`resize_image` keeps uint8 for bicubic on the CPU) and `(x - mean) / std`. tests/test_video.py checks the two
give identical tensors where torchvision is importable. Everything else (sampling, sizes, patches, the
prompt's timestamps and token counts) is transformers' own code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from transformers.image_utils import SizeDict
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

from vismmoe_edge.errors import VismmoeError

# Each frame's pixels when nothing says otherwise: 128 LLM tokens per pair of frames (32x32 pixels a token at
# Qwen3-VL's patch 16 and merge 2). The reference's 768 tokens a frame (transformers' `max_video_tokens`) would
# make a 4 s clip at 2 fps 3,072 tokens, more than the whole prompt budget of an edge daemon.
DEFAULT_FRAME_PIXELS = 128 * 32 * 32


def torchvision_available() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # ImportError, or a torchvision built for another torch failing to load its ops
        return False
    return True


class TorchFreeQwen3VLVideoProcessor(Qwen3VLVideoProcessor):
    """transformers' Qwen3-VL video processor with its three torchvision calls done in torch (see above)."""

    def convert_to_rgb(self, video: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if video.shape[-3] == 1:  # tvF.grayscale_to_rgb repeats the one channel
            video = video.expand(*video.shape[:-3], 3, *video.shape[-2:])
        if video.shape[-3] != 3:
            raise ValueError(f"video frames must be RGB or greyscale, got {video.shape[-3]} channels")
        return video

    def resize(  # type: ignore[override]
        self,
        videos: torch.Tensor,
        size: SizeDict,
        resample: Any,
        factor: int,
        temporal_factor: int,
        cap_pixels_per_frame: bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # The size: Qwen3VLVideoProcessor.resize's arithmetic (transformers 5.24), line for line.
        if not size.shortest_edge or not size.longest_edge:
            raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size}.")
        num_frames = videos.shape[1]
        max_pixels = size.longest_edge
        if cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            pixels_per_frame = max(min(frame_cap, size.longest_edge // num_frames), int(size.shortest_edge * 1.05))
            max_pixels = pixels_per_frame * num_frames
        height, width = videos.shape[-2:]
        new_height, new_width = smart_resize(
            height=height,
            width=width,
            num_frames=num_frames,
            factor=factor,
            temporal_factor=temporal_factor,
            min_pixels=size.shortest_edge,
            max_pixels=max_pixels,
        )
        return bicubic_resize(videos, new_height, new_width)

    def normalize(self, image: torch.Tensor, mean: Any, std: Any, inplace: bool = False, **kwargs: Any) -> torch.Tensor:
        # tvF.normalize: sub_(mean).div_(std) with mean and std as [C, 1, 1]
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        if not inplace:
            image = image.clone()
        return image.sub_(mean).div_(std)


def bicubic_resize(videos: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[..., C, H, W] to [..., C, height, width] as torchvision's resize_image does it on the CPU: bicubic with
    antialiasing, uint8 in and out (elsewhere it goes through float32, clamped and rounded)."""
    *lead, channels, old_height, old_width = videos.shape
    if (old_height, old_width) == (height, width):
        return videos
    flat = videos.reshape(-1, channels, old_height, old_width)
    native = flat.dtype in (torch.float32, torch.float64) or (flat.dtype == torch.uint8 and flat.device.type == "cpu")
    source = flat if native else flat.float()
    out = torch.nn.functional.interpolate(
        source, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    if not native:
        if flat.dtype == torch.uint8:
            out = out.clamp_(0, 255)
        out = out.round_().to(flat.dtype)
    return out.reshape(*lead, channels, height, width)


def read_video_config(model_dir: Path, image_processor: Any) -> dict[str, Any]:
    """The checkpoint's video processor settings: processor_config.json's "video_processor", else
    video_preprocessor_config.json, else the image processor's patch, merge and normalisation (the vision tower
    is shared) over transformers' Qwen3-VL defaults. Our demo checkpoint has none."""
    combined = model_dir / "processor_config.json"
    separate = model_dir / "video_preprocessor_config.json"
    try:
        if combined.is_file() and isinstance(json.loads(combined.read_text()).get("video_processor"), dict):
            return dict(json.loads(combined.read_text())["video_processor"])
        if separate.is_file():
            return dict(json.loads(separate.read_text()))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise VismmoeError(f"cannot read the video processor settings in {model_dir}: {e}") from None
    keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    derived = {k: getattr(image_processor, k) for k in keys if getattr(image_processor, k, None) is not None}
    shortest = (getattr(image_processor, "size", None) or {}).get("shortest_edge")
    if shortest:  # the least pixels; the largest is set per frame (with_frame_pixels)
        derived["size"] = {"shortest_edge": int(shortest), "longest_edge": int(shortest)}
    return derived


def build_video_processor(model_dir: Path, image_processor: Any, frame_pixels: int = DEFAULT_FRAME_PIXELS) -> Any:
    """The video processor for a Qwen3-VL checkpoint, each frame capped at `frame_pixels` pixels."""
    settings = read_video_config(Path(model_dir), image_processor)
    settings = {k: v for k, v in settings.items() if k not in ("processor_class", "video_processor_type")}
    cls = Qwen3VLVideoProcessor if torchvision_available() else TorchFreeQwen3VLVideoProcessor
    try:
        processor = cls(**settings)
    except (TypeError, ValueError) as e:
        raise VismmoeError(f"invalid video processor settings in {model_dir}: {e}") from None
    return with_frame_pixels(processor, frame_pixels)


def with_frame_pixels(video_processor: Any, frame_pixels: int) -> Any:
    """A copy whose frames are each at most `frame_pixels` pixels, whatever the clip's length: the reference's
    per-frame cap (`cap_pixels_per_frame`, `max_video_tokens`) with a total budget too large to bind first."""
    factor = video_processor.patch_size * video_processor.merge_size
    tokens = frame_pixels // (factor * factor)
    if tokens < 1:
        raise VismmoeError(f"--video-max-pixels {frame_pixels}: a frame needs at least {factor * factor} pixels")
    out = copy.deepcopy(video_processor)
    out.max_video_tokens = tokens
    out.cap_pixels_per_frame = True
    out.size = {"shortest_edge": out.size["shortest_edge"], "longest_edge": tokens * factor * factor * out.max_frames}
    return out


def attach_video_processor(processor: Any, model_dir: Path) -> Any:
    """Give a processor loaded without its video processor (processing.image_only) one (Qwen3-VL)."""
    processor.video_processor = build_video_processor(model_dir, processor.image_processor)
    return processor


def set_frame_pixels(processor: Any, frame_pixels: int) -> None:
    """Cap each video frame of `processor` at `frame_pixels` pixels (run's and serve's --video-max-pixels)."""
    video = getattr(processor, "video_processor", None)
    if video is None:
        raise VismmoeError("this model family takes no video input (Qwen3-VL-MoE does)")
    processor.video_processor = with_frame_pixels(video, frame_pixels)
