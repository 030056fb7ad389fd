#!/usr/bin/env python3
"""Load test of `vismmoe-edge serve`: many clients that honour Retry-After against one real daemon.

Starts a daemon (the trained demo model by default, on the CPU) on a free loopback port, runs --clients
threads that together send --requests chat completions (each its own prompt, with the sample image unless
--text-only), retrying 429 and 503 answers after the time the daemon asks for (retry-after-ms when present, as
the openai clients do, else Retry-After), and reports:

- errors: requests that did not end in a 200 (after retries), and transport failures;
- latency of the answered attempt (send to reply): its p50, p95 and max, against the bound
  1.5 x (queue depth + 1) x the median service time of the same run (the daemon's own `service_s`);
- end-to-end latency of each request, retries included, and how many 429s it took (fairness: the spread).

Traffic goes to 127.0.0.1 only; every loop is bounded in count and time, and the daemon is stopped at the end.

    python tools/bench/load_test.py                          # 50 clients, 300 requests, --max-queue 8
    python tools/bench/load_test.py --clients 10 --requests 40 --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    index: int
    status: int | str = 0
    attempts: int = 0
    refusals: int = 0  # 429 and 503 answers retried
    first_sent: float = 0.0
    answered_latency_s: float = 0.0  # the attempt that was answered: send to reply
    end_to_end_s: float = 0.0  # first send to reply, retries included
    service_s: float = 0.0  # the daemon's work on it (decode of images, prefill, decode)
    queue_s: float = 0.0


@dataclass
class Report:
    clients: int
    requests: int
    max_queue: int
    errors: int
    error_samples: list[str] = field(default_factory=list)
    refusals: int = 0
    median_service_s: float = 0.0
    bound_s: float = 0.0
    answered_p50_s: float = 0.0
    answered_p95_s: float = 0.0
    answered_max_s: float = 0.0
    end_to_end_p50_s: float = 0.0
    end_to_end_p95_s: float = 0.0
    end_to_end_max_s: float = 0.0
    max_refusals_one_request: int = 0
    wall_s: float = 0.0
    # wall / answered: how long the one worker really takes per request, service_s plus what happens between
    # requests (HTTP, the refused attempts' handling); a queue drains at this pace, not at the median service
    drain_s_per_request: float = 0.0
    passed: bool = False
    machine: str = ""
    date: str = ""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))  # nearest rank
    return ordered[k]


def start_daemon(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "vismmoe_edge.cli", "serve", "--port", "0", "--max-queue", str(args.max_queue)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += ["--device", "cpu", "--max-tokens", str(max(args.max_tokens, 16)), *args.serve_arg]
    return launch_daemon(cmd, log_path, args.start_timeout)


def launch_daemon(cmd: list[str], log_path: Path, timeout: float) -> tuple[subprocess.Popen, int]:
    """Start `vismmoe-edge serve ... --port 0` from this checkout (the caller's PYTHONPATH kept after it), its
    output in `log_path`; returns the process and the port it reports ready on."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=REPO)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = log_path.read_text(errors="replace")
        if " ready: " in text:
            return proc, int(text.split("ready: ", 1)[1].split("127.0.0.1:", 1)[1].split()[0])
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the daemon did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


def sample_image_url() -> str:
    import base64

    sys.path.insert(0, str(REPO))
    from vismmoe_edge.evaluation.sample import ensure_sample_image

    return "data:image/png;base64," + base64.b64encode(ensure_sample_image().read_bytes()).decode()


def body_for(index: int, args: argparse.Namespace, image: str | None) -> bytes:
    question = f"Request {index}: what colour is the circle?"
    content: list[dict] = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    request = {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens}
    if args.min_tokens:
        request["min_tokens"] = args.min_tokens
    return json.dumps(request).encode()


def run_request(port: int, outcome: Outcome, body: bytes, deadline: float) -> None:
    outcome.first_sent = time.monotonic()
    while time.monotonic() < deadline:
        outcome.attempts += 1
        sent = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(1.0, deadline - sent))
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            payload = resp.read()
            now = time.monotonic()
            if resp.status in (429, 503):
                outcome.refusals += 1
                ms = resp.getheader("retry-after-ms")
                wait = float(ms) / 1000 if ms else float(resp.getheader("Retry-After") or 1)
                time.sleep(min(max(wait, 0.0), max(0.0, deadline - time.monotonic())))
                continue
            outcome.status = resp.status
            outcome.answered_latency_s = now - sent
            outcome.end_to_end_s = now - outcome.first_sent
            if resp.status == 200:
                timings = json.loads(payload).get("vismmoe", {}).get("timings", {})
                outcome.service_s = float(timings.get("service_s", 0.0))
                outcome.queue_s = float(timings.get("queue_s", 0.0))
            return
        except (OSError, http.client.HTTPException) as e:
            outcome.status = f"{type(e).__name__}: {e}"
            return
        finally:
            conn.close()
    outcome.status = "gave up: the run's deadline passed"


def load_test(args: argparse.Namespace) -> Report:
    log_path = Path(args.log)
    proc, port = start_daemon(args, log_path)
    image = None if args.text_only else sample_image_url()
    outcomes = [Outcome(i) for i in range(args.requests)]
    next_index = iter(range(args.requests))
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + args.deadline

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None or time.monotonic() > deadline:
                return
            run_request(port, outcomes[index], body_for(index, args, image), deadline)

    try:
        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 30)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    wall = time.monotonic() - start
    ok = [o for o in outcomes if o.status == 200]
    errors = [o for o in outcomes if o.status != 200]
    median_service = statistics.median(o.service_s for o in ok) if ok else 0.0
    bound = 1.5 * (args.max_queue + 1) * median_service
    answered = [o.answered_latency_s for o in ok]
    report = Report(
        clients=args.clients,
        requests=args.requests,
        max_queue=args.max_queue,
        errors=len(errors),
        error_samples=sorted({str(o.status) for o in errors})[:5],
        refusals=sum(o.refusals for o in outcomes),
        median_service_s=median_service,
        bound_s=bound,
        answered_p50_s=percentile(answered, 50),
        answered_p95_s=percentile(answered, 95),
        answered_max_s=max(answered, default=0.0),
        end_to_end_p50_s=percentile([o.end_to_end_s for o in ok], 50),
        end_to_end_p95_s=percentile([o.end_to_end_s for o in ok], 95),
        end_to_end_max_s=max((o.end_to_end_s for o in ok), default=0.0),
        max_refusals_one_request=max((o.refusals for o in outcomes), default=0),
        wall_s=wall,
        drain_s_per_request=wall / len(ok) if ok else 0.0,
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        date=time.strftime("%Y-%m-%d"),
    )
    report.passed = report.errors == 0 and report.answered_p95_s <= bound
    if args.json:
        Path(args.json).write_text(json.dumps({"report": asdict(report), "requests": [asdict(o) for o in outcomes]}))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-queue", type=int, default=8, help="the daemon's --max-queue")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=0, help="force replies this long (steadier service times)")
    parser.add_argument("--model", help="model directory; default: the built-in demo model")
    parser.add_argument("--text-only", action="store_true", help="no image in the requests")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument for `serve`")
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--log", default="/tmp/vismmoe-load-test.log", help="the daemon's log")
    parser.add_argument("--json", help="write the report and every request's outcome here")
    args = parser.parse_args()
    if not 1 <= args.clients <= 200 or not 1 <= args.requests <= 5000:
        parser.error("--clients in [1, 200] and --requests in [1, 5000]")
    r = load_test(args)
    print(f"{r.requests} requests from {r.clients} clients, --max-queue {r.max_queue}: {r.errors} errors "
          f"{r.error_samples or ''}, {r.refusals} answers 429/503 retried (at most {r.max_refusals_one_request} for "
          f"one request), {r.wall_s:.1f} s")  # fmt: skip
    print(f"drain time per answered request (wall / answered) {r.drain_s_per_request:.3f} s")
    print(f"median service time {r.median_service_s:.3f} s; bound 1.5 x ({r.max_queue} + 1) x median = "
          f"{r.bound_s:.2f} s")  # fmt: skip
    print(f"answered attempt latency: p50 {r.answered_p50_s:.2f} s, p95 {r.answered_p95_s:.2f} s, "
          f"max {r.answered_max_s:.2f} s")  # fmt: skip
    print(f"end to end, retries included: p50 {r.end_to_end_p50_s:.2f} s, p95 {r.end_to_end_p95_s:.2f} s, "
          f"max {r.end_to_end_max_s:.2f} s")  # fmt: skip
    print("PASS" if r.passed else "FAIL")
    return 0 if r.passed else 1


if __name__ == "__main__":
    sys.exit(main())
