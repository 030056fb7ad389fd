"""Video input (issue 26): a clip file or a list of frames through transformers' Qwen3-VL video processor, the
engine against transformers' own model on the same checkpoint, and the frame and token bounds in `run` and in
the daemon (real HTTP server, official openai client).

The demo model was trained on images only, so these tests compare tokens, not answers. Clip files are made here
with PyAV (the `video` extra); the tests that need it are skipped without it, the frame-list ones are not.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from serve_support import REPO, Server, random_demo_model

from vismmoe_edge import demo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.video import INSTALL_HINT, VideoSettings, clip_from_images

NEW_TOKENS = 6


def frame(i: int, size: tuple[int, int] = (96, 64)) -> Image.Image:
    """A red circle moving right on white: frame i."""
    img = Image.new("RGB", size, (250, 250, 250))
    ImageDraw.Draw(img).ellipse((5 + 3 * i, 10, 35 + 3 * i, 40), fill=(220, 30, 30))
    return img


def make_clip(path: Path, frames: int, fps: int = 10, size: tuple[int, int] = (96, 64)) -> Path:
    """An MPEG-4 Part 2 clip in MP4 (FFmpeg's own encoder, in every PyAV wheel)."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_image(frame(i, size))):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def png_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---- the engine against transformers' own model --------------------------------------------------------


@pytest.fixture(scope="module")
def demo_pair() -> tuple[Any, Any]:
    """Our engine and transformers' model on the shipped demo checkpoint, both float32 on the CPU."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.loader import load

    engine = load(demo.TRAINED_DEMO_DIR, device="cpu", dtype="float32")
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        demo.TRAINED_DEMO_DIR, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    return engine, model


def hf_tokens(model: Any, inputs: Any) -> list[int]:
    """transformers' greedy tokens, fed exactly what the processor returned."""
    kwargs = {"input_ids": inputs.input_ids, "attention_mask": torch.ones_like(inputs.input_ids)}
    kwargs["mm_token_type_ids"] = inputs.mm_token_type_ids
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if getattr(inputs, name) is not None:
            kwargs[name] = getattr(inputs, name)
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    model.model.rope_deltas = None
    return out[0, inputs.num_tokens :].tolist()


def our_tokens(engine: Any, inputs: Any) -> list[int]:
    from vismmoe_edge.sampling import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return engine.generate_from_inputs(inputs, sampling).token_ids


def test_video_file_answers_as_transformers_does(demo_pair, tmp_path: Path) -> None:
    from vismmoe_edge.video import read_clips

    engine, model = demo_pair
    path = make_clip(tmp_path / "clip.mp4", frames=20, fps=10)  # 2 s: 4 frames at 2 fps
    clips = read_clips(engine.processor, [path], [], VideoSettings(fps=2.0), 128 * 32 * 32)
    assert clips[0].indices == [0, 6, 13, 19]  # transformers' sample_frames: 4 frames, spread over the clip
    inputs = engine.encode("What colour is the circle?", [], clips)
    assert inputs.video_grid_thw.tolist() == [[2, 4, 6]]  # 2 frame pairs of 64x96 pixels, patch 16
    text = engine.processor.tokenizer.decode(inputs.input_ids[0])
    assert "<0.3 seconds>" in text and "<1.6 seconds>" in text  # each frame pair's timestamp, from the indices
    assert our_tokens(engine, inputs) == hf_tokens(model, inputs)


def test_frames_beside_an_image_answer_as_transformers_does(demo_pair) -> None:
    """A clip of frames and an image in one prompt: tokens and DeepStack features joined in prompt order."""
    engine, model = demo_pair
    clip = clip_from_images([frame(i, (64, 64)) for i in range(3)], VideoSettings(fps=1.0))
    inputs = engine.encode("Is the circle in both?", [frame(5, (96, 96))], [clip])
    assert inputs.pixel_values is not None and inputs.video_grid_thw.tolist() == [[2, 4, 4]]  # 3 frames padded
    tokens = our_tokens(engine, inputs)
    assert tokens == hf_tokens(model, inputs)
    from vismmoe_edge.compress.config import CompressionConfig

    engine.compression = CompressionConfig("random", 0.5)
    try:  # a prompt with a clip is not compressed, and says so
        assert our_tokens(engine, inputs) == tokens
        assert engine.last_compression.note == "not applied: video tokens are not compressed"
    finally:
        engine.compression = CompressionConfig()


# ---- the processor ----------------------------------------------------------------------------------


def test_visual_tokens_are_transformers_count_and_frames_stay_under_the_pixel_cap() -> None:
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor
    from vismmoe_edge.models.video_processing import set_frame_pixels
    from vismmoe_edge.prompt import encode_prompt

    processor = load_qwen3_vl_processor(demo.TRAINED_DEMO_DIR)
    for frame_pixels, frames, size in [(128 * 1024, 4, (640, 360)), (32 * 1024, 5, (300, 500)), (8192, 2, (64, 64))]:
        set_frame_pixels(processor, frame_pixels)
        video = processor.video_processor
        clip = clip_from_images([frame(i, size) for i in range(frames)], VideoSettings(fps=2.0))
        inputs = encode_prompt(processor, "hi", [], [clip])
        t, h, w = inputs.video_grid_thw[0].tolist()
        assert h * w * 16 * 16 <= max(frame_pixels, int(video.size["shortest_edge"] * 1.05))
        counted = video.get_num_of_video_patches(frames, size[1], size[0]) // video.merge_size**2
        assert int((inputs.input_ids == 7).sum()) == counted == t * h * w // 4  # <|video_pad|> is id 7


def test_torch_free_processor_gives_torchvisions_tensors() -> None:
    """Where torchvision is importable, the torch-only replacement of its three calls changes no value."""
    pytest.importorskip("torchvision.transforms.v2.functional")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from vismmoe_edge.models.video_processing import TorchFreeQwen3VLVideoProcessor

    rng = np.random.default_rng(0)
    settings = {"patch_size": 16, "size": {"shortest_edge": 4096, "longest_edge": 1 << 24}, "max_video_tokens": 96}
    ours, theirs = TorchFreeQwen3VLVideoProcessor(**settings), Qwen3VLVideoProcessor(**settings)
    for shape in [(4, 97, 203, 3), (3, 480, 640, 3), (2, 64, 64, 3)]:
        video = rng.integers(0, 256, shape, dtype=np.uint8)
        kwargs = {"do_sample_frames": False, "cap_pixels_per_frame": True, "return_tensors": "pt"}
        a, b = ours(videos=[video], **kwargs), theirs(videos=[video], **kwargs)
        assert torch.equal(a["video_grid_thw"], b["video_grid_thw"])
        assert torch.equal(a["pixel_values_videos"], b["pixel_values_videos"])


def test_clip_refusals_are_one_line(tmp_path: Path) -> None:
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor
    from vismmoe_edge.video import read_video

    with pytest.raises(VismmoeError, match="at least 2"):
        clip_from_images([frame(0)], VideoSettings())
    with pytest.raises(VismmoeError, match="differ in size"):
        clip_from_images([frame(0), frame(1, (64, 64))], VideoSettings())
    with pytest.raises(VismmoeError, match="more than the limit of 2"):
        clip_from_images([frame(i) for i in range(3)], VideoSettings(max_frames=2))
    (tmp_path / "notes.mp4").write_text("not a video at all")
    video = load_qwen3_vl_processor(demo.TRAINED_DEMO_DIR).video_processor
    with pytest.raises(VismmoeError, match="not an MP4/MOV, WebM/Matroska or AVI video"):
        read_video(tmp_path / "notes.mp4", VideoSettings(), video)
    path = make_clip(tmp_path / "long.mp4", frames=40, fps=10)  # 4 s at 2 fps: 8 frames
    with pytest.raises(VismmoeError) as refused:
        read_video(path, VideoSettings(fps=2.0, max_frames=6), video)
    assert str(refused.value) == (
        f"{path}: 4.0 s of video at 2 fps is 8 frames, more than the limit of 6; send a shorter clip or a lower fps"
    )


# ---- run ------------------------------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vismmoe_edge.cli", "run", *args],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )  # fmt: skip


def test_run_takes_a_clip_and_refuses_past_the_bounds(tmp_path: Path) -> None:
    path = make_clip(tmp_path / "clip.mp4", frames=20, fps=10)
    ok = run_cli("--video", str(path), "--prompt", "What moves?", "--max-new-tokens", "3", "--json")
    assert ok.returncode == 0, ok.stderr
    import json

    reply = json.loads(ok.stdout)
    assert reply["prompt_token_ids"].count(7) == 12  # <|video_pad|>: 2 frame pairs of 2x3 merged 32-pixel patches
    from tests.test_cli import run_cli_in_process  # the same clip and path as the subprocess above

    over = run_cli_in_process(
        "run", "--video", str(path), "--video-fps", "5", "--video-max-frames", "8", "--prompt", "x"
    )
    assert over.returncode == 2 and over.stderr.strip().splitlines()[-1] == (
        f"error: --video {path}: 2.0 s of video at 5 fps is 10 frames, more than the limit of 8; send a shorter "
        "clip or a lower fps"
    )


def test_run_refuses_a_clip_past_the_models_context(tmp_path: Path) -> None:
    """40 frames of 512x512 at 256 tokens a frame pair: 5,120 visual tokens, past the demo's 4,096 positions."""
    names = []
    for i in range(40):
        frame(i, (512, 512)).save(tmp_path / f"f{i}.png")
        names.append(str(tmp_path / f"f{i}.png"))
    args = ["--video-frames", ",".join(names), "--video-max-frames", "40", "--video-max-pixels", str(512 * 512)]
    proc = run_cli(*args, "--prompt", "x")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the prompt is ") and "more than the model's context of 4096 tokens" in last


def test_without_pyav_a_file_fails_with_the_extra_named_and_frames_still_work(tmp_path: Path) -> None:
    blocker = tmp_path / "block" / "av"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('PyAV hidden by the test')\n")
    env = {"PYTHONPATH": f"{blocker.parent}{os.pathsep}{REPO}"}
    (tmp_path / "clip.mp4").write_bytes(b"\0\0\0\x18ftypmp42")
    proc = run_cli("--video", str(tmp_path / "clip.mp4"), "--prompt", "x", env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: reading a video file needs PyAV: {INSTALL_HINT}"]
    for i in range(2):
        frame(i).save(tmp_path / f"f{i}.png")
    frames = f"{tmp_path / 'f0.png'},{tmp_path / 'f1.png'}"
    ok = run_cli("--video-frames", frames, "--prompt", "x", "--max-new-tokens", "2", "--json", env=env)
    assert ok.returncode == 0, ok.stderr


# ---- the daemon -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The random demo model with small bounds: 6 frames a clip, 64 tokens a frame pair, 150 prompt tokens."""
    root = tmp_path_factory.mktemp("video-server")
    (root / "clips").mkdir()
    make_clip(root / "clips" / "clip.mp4", frames=20, fps=10)  # a local clip the server may read
    args = ["--model", str(random_demo_model()), "--port", "0", "--tier", "host", "--pinned-layers", "0"]
    args += ["--image-dir", str(root / "clips"), "--max-video-bytes", "16KiB"]
    args += ["--max-video-frames", "6", "--video-max-pixels", str(32 * 32 * 64), "--max-prompt-tokens", "150"]
    srv = Server([*args, "--max-tokens", "8"], root / "server.log", {})
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: Server) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def ask(client: Any, part: dict[str, Any]) -> Any:
    return client.chat.completions.create(
        model=random_demo_model().name,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What moves?"}]}],
        max_tokens=3,
    )


def test_daemon_answers_a_clip_and_a_list_of_frames(client: Any, tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "clip.mp4", frames=20, fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    reply = ask(client, {"type": "video_url", "video_url": {"url": url}})
    # 4 frames of 64x96: 2 frame pairs of 2x3 merged patches -> 12 visual tokens
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 12
    frames = {"type": "video", "video": [png_url(frame(i)) for i in range(4)], "fps": 2}
    reply = ask(client, frames)
    assert reply.usage.completion_tokens >= 1


def test_daemon_reads_a_local_clip_only_under_image_dir(server: Server, client: Any, tmp_path: Path) -> None:
    import openai

    local = server.log_path.parent / "clips" / "clip.mp4"
    assert ask(client, {"type": "video_url", "video_url": {"url": f"file://{local}"}}).usage.completion_tokens >= 1
    outside = make_clip(tmp_path / "outside.mp4", frames=20, fps=10)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, {"type": "video_url", "video_url": {"url": str(outside)}})
    assert refused.value.body["code"] == "image_unavailable"


def test_daemon_refuses_past_the_frame_and_token_bounds(client: Any, tmp_path: Path) -> None:
    import openai

    cases = [
        ({"type": "video", "video": [png_url(frame(i)) for i in range(7)]}, "too_many_frames", "more than the limit"),
        ({"type": "video", "video": [png_url(frame(0))]}, "invalid_value", "at least 2 frames"),
        (  # 6 frames are within the bound; 3 frame pairs of 64 tokens are not
            {"type": "video", "video": [png_url(frame(i, (256, 256))) for i in range(6)]},
            "context_length_exceeded",
            "192 visual tokens, more than the limit of 150",
        ),
    ]
    clip = make_clip(tmp_path / "long.mp4", frames=40, fps=10)  # 4 s: 8 frames at 2 fps
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    cases.append(({"type": "video_url", "video_url": {"url": url}}, "too_many_frames", "is 8 frames, more than"))
    big = "data:video/mp4;base64," + base64.b64encode(os.urandom(20_000)).decode()
    cases.append(({"type": "video_url", "video_url": {"url": big}}, "image_too_large", "video too large"))
    text = "data:video/mp4;base64," + base64.b64encode(b"just some text, not a clip").decode()
    cases.append(({"type": "video_url", "video_url": {"url": text}}, "invalid_value", "not an MP4/MOV"))
    for part, code, words in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, part)
        error = refused.value.body
        assert refused.value.status_code == 400 and error["code"] == code and words in error["message"], error
        assert "\n" not in error["message"]
