#!/usr/bin/env python3
"""One frame, many questions: time to first token of the first and of the second question about one image,
against one real `vismmoe-edge serve` daemon whose prefix cache keeps the image's prefill.

Starts the daemon (the trained demo model on the CPU by default; any checkpoint with --model and --device) on a
free loopback port, sends one warm-up request (its own frame), then for each of --runs frames (the image, tinted
differently each run: a frame the cache has not seen) asks the first question, then the second, each with
`max_tokens` 1, so that the reply comes back as soon as the first token exists; then the second question again
with the same pixels in other PNG bytes (found in the cache only after decoding and processing the image: what
the second question cost before seen_frames.py). Reports, per question, the median
of the client's wall time (send to reply: time to first token as a robot sees it, HTTP and image decode included)
and of the daemon's own `prefill_s`; their ratio; how many prompt tokens the second question reused; and, outside
the timed requests, whether the second question's greedy reply (--check-tokens tokens) is the same with the
cache as with `prefix_cache: false` (a cold prefill in the same daemon).

    python tools/bench/prefix_cache.py                                 # demo model, CPU, 7 frames
    python tools/bench/prefix_cache.py --model DIR --device cuda --image IMG --json out.json

Traffic goes to 127.0.0.1 only; the daemon is stopped at the end.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))

from load_test import launch_daemon  # noqa: E402

FIRST = "What colour is the circle?"
SECOND = "How many shapes are there?"


def start_daemon(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "vismmoe_edge.cli", "serve", "--port", "0", "--device", args.device]
    if args.model:
        cmd += ["--model", args.model]
    return launch_daemon([*cmd, *args.serve_arg], log_path, args.start_timeout)


def tinted(image: Path, index: int) -> Image.Image:
    """The image with its own tint: the same size (the same visual tokens), pixels the cache has not seen."""
    return Image.eval(Image.open(image).convert("RGB"), lambda v: (v + 11 * (index + 1)) % 256)


def frame_url(image: Path, index: int, compress_level: int = 6) -> str:
    """`tinted(image, index)` as a data URL; another `compress_level` gives other PNG bytes for the same pixels."""
    buf = io.BytesIO()
    tinted(image, index).save(buf, format="PNG", compress_level=compress_level)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(
    conn: http.client.HTTPConnection, url: str, question: str, max_tokens: int, **extra: object
) -> tuple[float, dict]:
    """(client wall seconds, the daemon's vismmoe block) of one non-streamed chat completion, on `conn`: one
    connection kept alive for every request, as the official openai client keeps its connections (httpx's pool),
    so no request pays for a TCP connection and a handler thread of its own."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
    sent = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    payload = resp.read()
    wall = time.perf_counter() - sent
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {payload[:300]!r}")
    return wall, json.loads(payload)["vismmoe"]


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("vismmoe_prefix_cache"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run(args: argparse.Namespace) -> dict:
    if args.image is None:
        sys.path.insert(0, str(REPO))
        from vismmoe_edge.evaluation.sample import ensure_sample_image

        args.image = ensure_sample_image()
    proc, port = start_daemon(args, Path(args.log))
    rows = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        ask(conn, frame_url(args.image, 1000), FIRST, 1)  # warm-up: first-request costs (allocations, graphs)
        for i in range(args.runs):
            url = frame_url(args.image, i)
            first_s, first = ask(conn, url, args.first, 1)
            second_s, second = ask(conn, url, args.second, 1)
            # the same pixels in other bytes: the cached features are found only after decoding and processing
            recoded_s, recoded = ask(conn, frame_url(args.image, i, compress_level=1), args.second, 1)
            _, warm = ask(conn, url, args.second, args.check_tokens)
            _, cold = ask(conn, url, args.second, args.check_tokens, prefix_cache=False)
            rows.append({
                "first_wall_s": first_s, "second_wall_s": second_s,
                "first_prefill_s": first["timings"]["prefill_s"], "second_prefill_s": second["timings"]["prefill_s"],
                # the worker's whole time on the request (prompt built, prefill, reply): wall less this is HTTP,
                # JSON and the queue; this less prefill_s is the worker's own host work around the prefill
                "first_service_s": first["timings"]["service_s"], "second_service_s": second["timings"]["service_s"],
                "second_queue_s": second["timings"]["queue_s"],  # waiting for the worker (its last job's tail)
                "first_vision_s": first["timings"]["vision_s"],
                "second_reused_tokens": second["timings"]["prefix_reused_tokens"],
                "second_vision_cached": second["timings"]["vision_cached_images"],
                "second_frames_seen": second["timings"]["frames_seen"],
                "second_suffix_graph_tokens": second["timings"].get("suffix_graph_tokens", 0),
                "recoded_wall_s": recoded_s, "recoded_prefill_s": recoded["timings"]["prefill_s"],
                "recoded_frames_seen": recoded["timings"]["frames_seen"],
                "tokens_identical": warm["token_ids"] == cold["token_ids"],
            })  # fmt: skip
            if warm["token_ids"] != cold["token_ids"]:  # judged in process by tools/device/prefix_cache_checks.py
                rows[-1] |= {"cached_token_ids": warm["token_ids"], "uncached_token_ids": cold["token_ids"]}
            print(json.dumps(rows[-1]), flush=True)
        counters = metrics(port)
    finally:
        conn.close()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "model": args.model or "demo (trained)",
        "device": args.device,
        "runs": args.runs,
        "first_wall_s": median("first_wall_s"),
        "second_wall_s": median("second_wall_s"),
        "wall_ratio": median("second_wall_s") / median("first_wall_s"),
        "first_prefill_s": median("first_prefill_s"),
        "second_prefill_s": median("second_prefill_s"),
        "first_service_s": median("first_service_s"),
        "second_service_s": median("second_service_s"),
        "second_queue_s": median("second_queue_s"),
        "prefill_ratio": median("second_prefill_s") / median("first_prefill_s"),
        "recoded_wall_s": median("recoded_wall_s"),
        "recoded_wall_ratio": median("recoded_wall_s") / median("first_wall_s"),
        "second_frames_seen": median("second_frames_seen"),
        "second_suffix_graph_tokens": median("second_suffix_graph_tokens"),
        "recoded_frames_seen": median("recoded_frames_seen"),
        "median_ratio_per_frame_wall": statistics.median(r["second_wall_s"] / r["first_wall_s"] for r in rows),
        "median_ratio_per_frame_prefill": statistics.median(r["second_prefill_s"] / r["first_prefill_s"] for r in rows),
        "second_reused_tokens": median("second_reused_tokens"),
        "tokens_identical": all(r["tokens_identical"] for r in rows),
        "metrics": counters,
        "rows": rows,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory; default: the built-in demo model")
    parser.add_argument("--device", default="cpu", help="the daemon's --device (cpu, cuda)")
    parser.add_argument("--image", type=Path, help="the frame; default: the demo's sample image")
    parser.add_argument("--runs", type=int, default=7, help="frames, each asked both questions")
    parser.add_argument("--first", default=FIRST)
    parser.add_argument("--second", default=SECOND)
    parser.add_argument("--check-tokens", type=int, default=8, help="reply length of the identity check")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument for `serve`")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--log", default="/tmp/vismmoe-prefix-cache.log", help="the daemon's log")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    report = run(args)
    summary = {k: v for k, v in report.items() if k not in ("rows", "metrics")}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = report["tokens_identical"] and report["second_reused_tokens"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
