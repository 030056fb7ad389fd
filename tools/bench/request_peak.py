#!/usr/bin/env python3
"""The real memory peak of one admitted request, against its decoded bytes and the peak admission plans for it.

A request's images are known from their headers: decoded bytes (4 bytes a pixel for RGB, PIL's RGBX, plus an
RGB copy for other modes: serve/images.py). The worker then decodes them and the model's processor converts
them (numpy arrays, float32 rescaling, patches), so the real peak is a multiple of the decoded bytes; admission
charges images.planned_peak against --max-decoded-bytes. This starts a daemon in a memory cgroup
(tools/bench/memcgroup.py; root, cgroup v1), warms it, and for each case sends one request alone and reads the
cgroup's peak (memory.max_usage_in_bytes, reset before each request) minus the usage just before it: the
request's real cost. Reported per case: decoded bytes, planned peak, cost, cost / decoded, cost / planned.
`--video` measures clips instead (serve/videos.py's planned peak; the video extra): a list of frames sent as a
`video` part and an MP4 file sent as a `video_url` part; their "decoded" is the sampled frames at 3 bytes a pixel.

    sudo python tools/bench/request_peak.py --json peak.json
    sudo python tools/bench/request_peak.py --video --json peak-video.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from bench import memcgroup  # noqa: E402
from bench.soak import Daemon  # noqa: E402

CASES = {  # name -> (count, side, PIL mode)
    "1 x 4096^2 RGB": (1, 4096, "RGB"),
    "1 x 4096^2 RGBA": (1, 4096, "RGBA"),
    "4 x 2048^2 RGB": (4, 2048, "RGB"),
    "8 x 4096^2 RGB": (8, 4096, "RGB"),
}

VIDEO_CASES = {  # name -> (part kind, frames sent or in the file, width, height, file fps)
    "32 frames 640x480 (video)": ("video", 32, 640, 480, 0),
    "8 frames 1280x720 (video)": ("video", 8, 1280, 720, 0),
    "16 s 1280x720 mp4 at 2 fps (video_url)": ("video_url", 160, 1280, 720, 10),
}


def png(side: int, mode: str) -> bytes:
    from PIL import Image

    img = Image.linear_gradient("L").resize((side, side)).convert(mode)  # compresses to tens of KiB
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def charges(count: int, side: int, mode: str) -> tuple[int, int]:
    """(decoded bytes, planned peak) of `count` images of side x side in `mode`, as admission computes them."""
    from vismmoe_edge.serve.images import PendingImage, planned_peak

    images = [PendingImage(b"", side, side, mode, "")] * count
    return sum(i.decoded_bytes for i in images), planned_peak(images)


def frame_png(i: int, width: int, height: int) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    ImageDraw.Draw(img).ellipse((10 + 7 * i, 10, 110 + 7 * i, 110), fill=(220, 30, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def mp4(frames: int, width: int, height: int, fps: int) -> bytes:
    import av
    from PIL import Image

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            img = Image.open(io.BytesIO(frame_png(i, width, height)))
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def video_case(model: str, kind: str, frames: int, width: int, height: int, fps: int) -> tuple[dict, int, int]:
    """(the part, decoded bytes, planned peak) of a clip, as the daemon's admission computes them."""
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor
    from vismmoe_edge.models.video_processing import set_frame_pixels
    from vismmoe_edge.serve.protocol import Limits
    from vismmoe_edge.serve.videos import VideoReader

    processor = load_qwen3_vl_processor(Path(model))
    limits = Limits(max_video_frames=32, max_video_bytes=64 << 20, max_image_bytes=64 << 20)
    set_frame_pixels(processor, limits.video_max_pixels)

    def load_image(url: str, param: str):  # noqa: ANN202
        from vismmoe_edge.serve.images import load_image_url

        return load_image_url(url, param, limits, ())

    reader = VideoReader(limits, (), processor.video_processor, load_image)
    if kind == "video":
        urls = [
            "data:image/png;base64," + base64.b64encode(frame_png(i, width, height)).decode() for i in range(frames)
        ]
        part = {"type": "video", "video": urls}
        pending = reader.from_frames(urls, None, "p")
    else:
        url = "data:video/mp4;base64," + base64.b64encode(mp4(frames, width, height, fps)).decode()
        part = {"type": "video_url", "video_url": {"url": url}}
        pending = reader.from_url(url, None, "p")
    return part, pending.frames * width * height * 3, pending.peak_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", default="8GiB")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--model", default=None, help="default: the random demo model (as the daemon's tests)")
    parser.add_argument("--video", action="store_true", help="measure clips (VIDEO_CASES) instead of images")
    args = parser.parse_args(argv)
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import ensure_random_demo_model

    model = args.model or str(ensure_random_demo_model())
    serve = ["--model", model, "--max-decoded-bytes", "4GiB", "--max-prompt-tokens", "16384", "--max-images", "8"]
    serve += ["--max-image-bytes", "64MiB", "--max-video-bytes", "64MiB", "--max-body-bytes", "128MiB"]
    ns = argparse.Namespace(max_tokens=2, serve_arg=serve)
    rows = []
    with memcgroup.MemoryCgroup(f"peak-{os.getpid()}", args.limit) as cgroup:
        d = Daemon(cgroup, ns, Path("/tmp/vismmoe-request-peak.log"))
        try:
            import http.client

            def send(parts: list[dict]) -> int:
                body = json.dumps({"messages": [{"role": "user", "content": parts}], "max_tokens": 2}).encode()
                conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=600)
                conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                conn.close()
                return resp.status

            small = "data:image/png;base64," + base64.b64encode(png(256, "RGB")).decode()
            for name, case in (VIDEO_CASES if args.video else CASES).items():
                if args.video:
                    part, decoded, planned = video_case(model, *case)
                    parts = [part, {"type": "text", "text": "?"}]
                else:
                    count, side, mode = case
                    url = "data:image/png;base64," + base64.b64encode(png(side, mode)).decode()
                    parts = [{"type": "image_url", "image_url": {"url": url}}] * count + [{"type": "text", "text": "?"}]
                    decoded, planned = charges(count, side, mode)
                assert send([{"type": "image_url", "image_url": {"url": small}}, {"type": "text", "text": "?"}]) == 200
                send(parts)  # once to warm what the first large prefill allocates (oneDNN caches)
                time.sleep(1.0)
                before = cgroup.usage_bytes()
                cgroup.reset_peak()
                status = send(parts)
                cost = cgroup.max_usage_bytes() - before
                rows.append({"case": name, "status": status, "decoded_bytes": decoded, "planned_bytes": planned,
                             "cost_bytes": cost, "per_decoded": round(cost / decoded, 2),
                             "per_planned": round(cost / planned, 2)})  # fmt: skip
                print(f"{name:>38}: status {status}, decoded {decoded / 2**20:7.1f} MiB, planned "
                      f"{planned / 2**20:7.1f} MiB, cost {cost / 2**20:7.1f} MiB: x{cost / decoded:.2f} of decoded, "
                      f"x{cost / planned:.2f} of planned", flush=True)  # fmt: skip
        finally:
            d.proc.terminate()
            d.proc.wait(timeout=60)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "model": model,
        "cases": rows,
        "worst_per_decoded": max(r["per_decoded"] for r in rows),
        "worst_per_planned": max(r["per_planned"] for r in rows),
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
