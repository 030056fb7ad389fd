"""A short clip as model input: frames read from a video file with PyAV, or a list of images taken as frames.

PyAV (`av`, FFmpeg's libraries in one wheel) is the optional `video` extra: it has manylinux wheels for aarch64
and x86_64 on PyPI and needs no torch; decord has no aarch64 wheel, torchcodec needs the system's FFmpeg and a
torch of its own build, opencv-python-headless is a larger wheel (docs/serving.md, "A short clip"). Without it, a
video *file* fails with one line naming the extra; frames sent as images need nothing.

Which frames are kept is transformers' own choice (`Qwen3VLVideoProcessor.sample_frames`: `fps` frames a second,
at least `min_frames`), made from the file's header before anything is decoded, so that a clip over the frame
bound is refused before it is decoded. Decoding then stops at the last kept frame. Only MP4/MOV, Matroska/WebM and
AVI are opened, with the demuxer named from the file's first bytes: FFmpeg never probes for another format (its
playlist demuxers open other URLs).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vismmoe_edge.errors import VismmoeError

INSTALL_HINT = "pip install 'vismmoe-edge[video]'"
DEFAULT_FPS = 2.0  # frames sampled a second (transformers' and Qwen's default)
DEFAULT_MAX_FRAMES = 32  # frames per clip after sampling: 16 s at 2 fps
MAX_SOURCE_FRAMES = 36_000  # frames in the file (20 minutes at 30 fps): decoding walks up to the last kept one
MIN_FRAMES = 2  # Qwen3-VL's temporal patch: a clip is at least two frames


@dataclass
class VideoSettings:
    """How a clip becomes frames: sampling rate and the bound on frames."""

    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES

    def __post_init__(self) -> None:
        if not 0 < self.fps <= 60:
            raise VismmoeError(f"video fps {self.fps}: give a rate in (0, 60] frames a second")
        if self.max_frames < MIN_FRAMES:
            raise VismmoeError(f"max video frames {self.max_frames}: a clip needs at least {MIN_FRAMES} frames")


@dataclass
class VideoHeader:
    """What a video file's header says, read before any frame is decoded."""

    container: str  # the FFmpeg demuxer it is opened with
    width: int
    height: int
    fps: float
    total_frames: int


@dataclass
class Clip:
    """Frames ready for the processor, and where in the source they came from (the prompt's timestamps)."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    fps: float  # of the source: frame index / fps = seconds
    indices: list[int] = field(default_factory=list)
    total_frames: int = 0

    def metadata(self) -> dict[str, Any]:
        """transformers' VideoMetadata fields: `frames_indices` and `fps` give each frame's timestamp."""
        return {
            "total_num_frames": self.total_frames or len(self.frames),
            "fps": self.fps,
            "frames_indices": list(self.indices or range(len(self.frames))),
            "height": int(self.frames.shape[1]),
            "width": int(self.frames.shape[2]),
        }


def import_av() -> Any:
    try:
        import av
    except ImportError:
        raise VismmoeError(f"reading a video file needs PyAV: {INSTALL_HINT}") from None
    return av


def sniff_container(head: bytes) -> str | None:
    """FFmpeg's demuxer for a file that starts with `head`, for the three container families we open."""
    if len(head) >= 12 and head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "avi"
    return None


def open_container(source: bytes | Path, where: str) -> Any:
    head = source[:12] if isinstance(source, bytes) else read_head(source, where)
    container = sniff_container(head)
    if container is None:
        raise VismmoeError(f"{where}: not an MP4/MOV, WebM/Matroska or AVI video")
    av = import_av()
    try:
        return av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), format=container)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise VismmoeError(f"{where}: cannot open the video ({one_line(e)})") from None


def read_head(path: Path, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(12)
    except OSError as e:
        raise VismmoeError(f"{where}: cannot read it ({e.strerror})") from None


def read_header(container: Any, where: str) -> VideoHeader:
    if not container.streams.video:
        raise VismmoeError(f"{where}: the file has no video stream")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    total = int(stream.frames or 0)
    if total <= 0 and fps > 0:  # Matroska and WebM often leave the count out: the duration says it
        seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0
        seconds = seconds or (container.duration or 0) / 1_000_000
        total = int(round(seconds * fps))
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if fps <= 0 or total <= 0 or width <= 0 or height <= 0:
        raise VismmoeError(f"{where}: the video's header gives no frame rate, length or size")
    return VideoHeader(container.format.name, width, height, fps, total)


def probe_video(source: bytes | Path, where: str) -> VideoHeader:
    """The header of a video file or of its bytes, without decoding a frame."""
    container = open_container(source, where)
    try:
        return read_header(container, where)
    finally:
        container.close()


def sample_indices(header: VideoHeader, settings: VideoSettings, video_processor: Any, where: str) -> list[int]:
    """The frames transformers' Qwen3-VL video processor keeps at `settings.fps`; over the bound: refused."""
    from transformers.video_utils import VideoMetadata

    if header.total_frames > MAX_SOURCE_FRAMES:
        raise VismmoeError(
            f"{where}: the video has {header.total_frames} frames, more than {MAX_SOURCE_FRAMES}; send a shorter clip"
        )
    metadata = VideoMetadata(total_num_frames=header.total_frames, fps=header.fps)
    indices = [int(i) for i in video_processor.sample_frames(metadata, fps=settings.fps)]
    if len(indices) > settings.max_frames:
        seconds = header.total_frames / header.fps
        raise VismmoeError(
            f"{where}: {seconds:.1f} s of video at {settings.fps:g} fps is {len(indices)} frames, more than the "
            f"limit of {settings.max_frames}; send a shorter clip or a lower fps"
        )
    if len(indices) < MIN_FRAMES:
        raise VismmoeError(f"{where}: the video has {len(indices)} frame; a clip needs {MIN_FRAMES} (send an image)")
    return indices


def decode_clip(source: bytes | Path, header: VideoHeader, indices: list[int], where: str) -> Clip:
    """Decode the frames at `indices` (and only up to the last of them) as RGB."""
    av = import_av()
    wanted = set(indices)
    last = max(indices)
    kept: list[np.ndarray] = []
    found: list[int] = []
    container = open_container(source, where)
    try:
        stream = container.streams.video[0]
        for number, frame in enumerate(container.decode(stream)):
            if number in wanted:
                if (frame.width, frame.height) != (header.width, header.height):
                    raise VismmoeError(f"{where}: the video changes size mid-stream; re-encode it at one size")
                kept.append(frame.to_ndarray(format="rgb24"))
                found.append(number)
            if number >= last:
                break
    except av.FFmpegError as e:
        raise VismmoeError(f"{where}: cannot decode the video ({one_line(e)})") from None
    finally:
        container.close()
    if len(kept) < MIN_FRAMES:
        raise VismmoeError(f"{where}: only {len(kept)} frame could be decoded; a clip needs {MIN_FRAMES}")
    return Clip(np.stack(kept), header.fps, found, header.total_frames)


def read_video(path: str | Path, settings: VideoSettings, video_processor: Any, where: str | None = None) -> Clip:
    """A video file's kept frames (run --video)."""
    path = Path(path)
    where = where or str(path)
    if not path.is_file():
        raise VismmoeError(f"{where}: video file not found" if not path.exists() else f"{where}: not a regular file")
    header = probe_video(path, where)
    return decode_clip(path, header, sample_indices(header, settings, video_processor, where), where)


def clip_from_images(images: list[Any], settings: VideoSettings, where: str = "frames") -> Clip:
    """Images (PIL, in order) taken as consecutive frames `1 / settings.fps` seconds apart."""
    if len(images) < MIN_FRAMES:
        raise VismmoeError(f"{where}: {len(images)} frame; a clip needs at least {MIN_FRAMES} (send one as an image)")
    if len(images) > settings.max_frames:
        raise VismmoeError(f"{where}: {len(images)} frames, more than the limit of {settings.max_frames}")
    sizes = {image.size for image in images}
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:3])
        raise VismmoeError(f"{where}: the frames differ in size ({shown}); send frames of one size")
    frames = np.stack([np.asarray(image.convert("RGB")) for image in images])
    return Clip(frames, settings.fps, list(range(len(images))), len(images))


def one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:200]


def read_clips(
    processor: Any, files: list[Path], frame_lists: list[str], settings: VideoSettings, frame_pixels: int
) -> list[Clip]:
    """`run`'s clips: each --video file, then each --video-frames list, with frames of at most `frame_pixels`."""
    from vismmoe_edge.models.video_processing import set_frame_pixels
    from vismmoe_edge.prompt import load_image

    if not files and not frame_lists:
        return []
    set_frame_pixels(processor, frame_pixels)
    clips = [read_video(path, settings, processor.video_processor, f"--video {path}") for path in files]
    for spec in frame_lists:
        images = [load_image(name) for name in split_frames(spec)]
        clips.append(clip_from_images(images, settings, f"--video-frames {spec[:60]}"))
    return clips


def split_frames(spec: str) -> list[str]:
    return [name.strip() for name in spec.split(",") if name.strip()]
