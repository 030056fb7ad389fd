#!/usr/bin/env python3
"""Soak test of `vismmoe-edge serve`: good clients and hostile ones together, for minutes, in a memory cgroup.

Starts a daemon (the trained demo model on the CPU, default limits) inside a cgroup-v1 memory cgroup of --limit
(tools/bench/memcgroup.py; root and cgroup v1 needed), then:

1. unloaded: one good client alone sends --baseline requests (the sample image and a question, retrying 429
   and 503 after the time the daemon asks for); their latencies are the reference;
2. loaded: for --minutes, the same good client again, while --hostile threads (from 127.0.0.2, another client
   to the daemon) loop over the attacks of issue 22: bodies that never arrive, headers a byte at a time, JSON
   that grows in memory (unknown and known fields), an 8 MB prompt, recursive and costly schemas, clients that
   leave mid-body, lone surrogates, a flood of idle connections, images too large to decode;
3. the end: every gauge read once the attackers have stopped (pending request bytes, queue places held), the
   daemon alive or not, the cgroup's OOM kills and peak, /health.

Reported (and --json): OOM kills, peak cgroup memory, gauges at the end, answers by attack and status (a 500
anywhere is a failure), and the good client's p50/p95 loaded vs unloaded. Passed when: no OOM kill, the daemon
alive, pending bytes 0, no 500, no good request failed, loaded p95 <= 1.5 x unloaded p95.

    sudo python tools/bench/soak.py --minutes 30 --json soak.json
    python tools/bench/soak.py --minutes 1 --hostile 4        # a quick look
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import platform
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from bench import memcgroup  # noqa: E402
from bench.load_test import percentile, sample_image_url  # noqa: E402

GAUGES = ("vismmoe_pending", "vismmoe_queue")  # the gauges that must come back to rest
HOSTILE_SOURCE = "127.0.0.2"  # the attackers are another client (the whole of 127/8 is loopback)


class Daemon:
    def __init__(self, cgroup: memcgroup.MemoryCgroup, args: argparse.Namespace, log_path: Path) -> None:
        cmd = [sys.executable, "-m", "vismmoe_edge.cli", "serve", "--port", "0", "--device", "cpu"]
        # The demo model is 10 M parameters: all of it resident, no plan (the profile's C_safe is 2 GiB alone).
        cmd += ["--memory-budget", "100%", "--pinned-layers", "0", "--tier", "host"]
        cmd += ["--max-tokens", str(args.max_tokens), *args.serve_arg]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = cgroup.popen(cmd, stdout=log, stderr=log, env=env, cwd=REPO)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            text = log_path.read_text(errors="replace")
            if " ready: " in text:
                self.port = int(text.split("ready: ", 1)[1].split("127.0.0.1:", 1)[1].split()[0])
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit(f"the daemon did not start:\n{text[-3000:]}")

    def connect(self, source: str = "127.0.0.1", timeout: float = 120) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", self.port))
        return sock

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def gauges(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


# ---- clients ---------------------------------------------------------------------------------------------------


def exchange(sock: socket.socket, data: bytes) -> int:
    """Send `data`, read one response; its status, or -1 when the connection ended without one."""
    try:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return -1
    finally:
        sock.close()


def head(length: int | None, extra: str = "") -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: localhost", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def post(body: bytes) -> bytes:
    return head(len(body)) + body


def schema_body(schema: object) -> bytes:
    spec = {"name": "x", "schema": schema}
    msgs = [{"role": "user", "content": "hi"}]
    return json.dumps({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": spec}}).encode()


def big_png_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.linear_gradient("L").resize((4096, 4096)).convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def attacks() -> dict[str, object]:
    """name -> a function(daemon) -> status. Built once: the bodies are megabytes."""
    bomb = b"[" + b"{}," * ((8 << 20) // 3) + b"{}]"
    hi = b'{"messages": [{"role": "user", "content": "hi"}], '
    prompt = json.dumps({"messages": [{"role": "user", "content": "a b " * 2_000_000}]}).encode()
    big = big_png_url()
    images = [{"type": "image_url", "image_url": {"url": big}}] * 8
    decoded = json.dumps({"messages": [{"role": "user", "content": images}]}).encode()
    endless = {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}

    def stalled_body(d: Daemon) -> int:
        return exchange(d.connect(HOSTILE_SOURCE), head(1 << 20) + b'{"messages": ')

    def slow_headers(d: Daemon) -> int:
        sock = d.connect(HOSTILE_SOURCE)
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 200:
                sock.sendall(bytes([byte]))
                time.sleep(0.5)
                sock.settimeout(0)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    pass
                sock.settimeout(120)
        except OSError:
            pass
        sock.settimeout(120)
        return exchange(sock, b"")

    def leave_mid_body(d: Daemon) -> int:
        sock = d.connect(HOSTILE_SOURCE)
        sock.sendall(head(1 << 20) + b"x" * 4096)
        time.sleep(0.2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        sock.close()
        return 0  # nothing to read: the point is the budget afterwards

    def idle_flood(d: Daemon) -> int:
        socks = []
        try:
            for _ in range(80):
                socks.append(d.connect(HOSTILE_SOURCE))
        except OSError:
            pass
        time.sleep(3)
        for sock in socks:
            sock.close()
        return 0

    simple = {
        "json_bomb_unknown_field": hi + b'"junk": ' + bomb + b"}",
        "json_bomb_known_field": hi + b'"metadata": ' + bomb + b"}",
        "prompt_8MB": prompt,
        "schema_ref_loop": schema_body({"$ref": "#"}),
        "schema_endless_chain": schema_body(endless),
        "schema_8MB_pattern": schema_body({"type": "string", "pattern": "a" * (8 << 20)}),
        "lone_surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "images_too_large_decoded": decoded,
    }
    out: dict[str, object] = {
        name: (lambda d, body=body: exchange(d.connect(HOSTILE_SOURCE), post(body))) for name, body in simple.items()
    }
    out |= {"stalled_body": stalled_body, "slow_headers": slow_headers, "leave_mid_body": leave_mid_body}
    out["idle_flood"] = idle_flood
    return out


def good_request(d: Daemon, body: bytes, deadline: float) -> tuple[int, float]:
    """(status, seconds from the first send to the answer, retries included)."""
    started = time.monotonic()
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=300)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status in (429, 503):
                ms = resp.getheader("retry-after-ms")
                time.sleep(float(ms) / 1000 if ms else float(resp.getheader("Retry-After") or 1))
                continue
            return resp.status, time.monotonic() - started
        except (OSError, http.client.HTTPException) as e:
            return -1, time.monotonic() - started if not isinstance(e, TimeoutError) else 300.0
        finally:
            conn.close()
    return -2, time.monotonic() - started


def good_body(index: int, image: str, max_tokens: int) -> bytes:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": f"{index}: what colour?"}]
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}).encode()


def good_run(d: Daemon, count: int | None, until: float | None, image: str, max_tokens: int) -> list[tuple[int, float]]:
    results = []
    i = 0
    while (count is None or i < count) and (until is None or time.monotonic() < until):
        results.append(good_request(d, good_body(i, image, max_tokens), time.monotonic() + 600))
        i += 1
    return results


# ---- the run ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--limit", default="1.5GiB", help="the memory cgroup's limit (the daemon's MemoryMax=)")
    parser.add_argument("--hostile", type=int, default=6, help="attacker threads")
    parser.add_argument("--baseline", type=int, default=30, help="good requests of the unloaded run")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `serve` argument (repeatable)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=Path("/tmp/vismmoe-soak-server.log"))
    args = parser.parse_args(argv)
    ok, why = memcgroup.memory_cgroup_support()
    if not ok:
        raise SystemExit(f"soak: no usable cgroup v1 memory controller: {why}")
    image = sample_image_url()
    plan = attacks()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with memcgroup.MemoryCgroup(f"soak-{os.getpid()}", args.limit) as cgroup:
        d = Daemon(cgroup, args, args.log)
        try:
            good_run(d, 3, None, image, args.max_tokens)  # warm-up: oneDNN caches, the first prefill
            unloaded = good_run(d, args.baseline, None, image, args.max_tokens)
            cgroup.reset_peak()
            stop = threading.Event()
            answers: Counter[str] = Counter()
            lock = threading.Lock()
            names = sorted(plan)

            def attacker(k: int) -> None:
                i = k
                while not stop.is_set():
                    name = names[i % len(names)]
                    i += 1
                    try:
                        status = plan[name](d)  # type: ignore[operator]
                    except Exception as e:  # noqa: BLE001 - an attack that fails to run is counted, not fatal
                        status = f"client error {type(e).__name__}"
                    with lock:
                        answers[f"{name} {status}"] += 1

            threads = [threading.Thread(target=attacker, args=(k,), daemon=True) for k in range(args.hostile)]
            loaded_start = time.monotonic()
            for t in threads:
                t.start()
            samples = []
            loaded: list[tuple[int, float]] = []
            until = loaded_start + args.minutes * 60
            sampler_stop = threading.Event()

            def sampler() -> None:
                while not sampler_stop.wait(15):
                    try:
                        g = d.gauges()
                    except OSError:
                        g = {}
                    samples.append({"t_s": round(time.monotonic() - loaded_start), "usage": cgroup.usage_bytes(),
                                    "pending": g.get("vismmoe_pending_request_bytes")})  # fmt: skip

            sampler_thread = threading.Thread(target=sampler, daemon=True)
            sampler_thread.start()
            loaded = good_run(d, None, until, image, args.max_tokens)
            stop.set()
            for t in threads:
                t.join(timeout=180)
            sampler_stop.set()
            time.sleep(2)
            alive = d.proc.poll() is None
            gauges = d.gauges() if alive else {}
            health = d.get("/health")[0] if alive else None
            report = {
                "date": started_at,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                "minutes": args.minutes,
                "limit_bytes": memcgroup.parse_size(args.limit),
                "hostile_threads": args.hostile,
                "oom_kills": cgroup.oom_kills(),
                "daemon_alive": alive,
                "returncode": d.proc.returncode,
                "peak_bytes_loaded": cgroup.max_usage_bytes(),
                "health_at_end": health,
                "gauges_at_end": {k: v for k, v in gauges.items() if k.startswith(GAUGES)},
                "answers": dict(sorted(answers.items())),
                "good_unloaded": summary(unloaded),
                "good_loaded": summary(loaded),
                "samples": samples,
            }
        finally:
            if d.proc.poll() is None:
                d.proc.terminate()
                try:
                    d.proc.wait(timeout=60)
                except Exception:  # noqa: BLE001
                    d.proc.kill()
    fives = sum(n for k, n in report["answers"].items() if k.split()[-1].startswith("5") and k.split()[-1] != "503")
    report["server_errors"] = fives
    bad_good = report["good_loaded"]["failed"] + report["good_unloaded"]["failed"]
    ratio = report["good_loaded"]["p95_s"] / max(1e-9, report["good_unloaded"]["p95_s"])
    report["p95_ratio"] = round(ratio, 3)
    report["passed"] = bool(
        report["oom_kills"] == 0 and report["daemon_alive"] and report["gauges_at_end"].get(
            "vismmoe_pending_request_bytes") == 0 and fives == 0 and bad_good == 0 and ratio <= 1.5
    )  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if report["passed"] else 1


def summary(results: list[tuple[int, float]]) -> dict[str, float]:
    times = [s for status, s in results if status == 200]
    return {
        "requests": len(results),
        "failed": sum(1 for status, _ in results if status != 200),
        "p50_s": round(percentile(times, 50), 3),
        "p95_s": round(percentile(times, 95), 3),
        "max_s": round(max(times, default=0.0), 3),
    }


if __name__ == "__main__":
    raise SystemExit(main())
