#!/usr/bin/env python3
"""Why is a llama-bench process slow right after one of our trials? Run a sequence of steps and probe each.

Steps (comma-separated, run in order, each in its own capped memory cgroup with its files evicted first):

    llama      one llama-bench tgN process on --gguf (tools/bench/llamacpp.py's, with its probes: the GGUF's
               page-cache residency when the timed section starts, the child's CPU seconds, the host's vmstat /
               CPU-time / disk deltas over the process)
    ours       one of our trials (tools/bench/unified.py's worker, --strategy on --model)
    read       read --model's shards once, cold, inside the cap (disk and page-cache traffic, no compute)
    spin       2 busy threads for 20 s (CPU load without memory traffic)
    sleepN     N seconds idle

    python tools/bench/baseline_probe.py --gguf $G.Q4_K_M.gguf --llama-build $BENCH_DATA/llama/build \
        --model $M-int4 --strategy q:popularity --cap-of $M --cap 0.4 \
        --sequence llama,llama,llama,ours,llama,llama,llama,read,llama,llama --json probe.json

($BENCH_DATA, $M, $G: docs/benchmark-setup.md. What it found: docs/benchmarks.md, "The CPU proxy's baseline at
its steady state".)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TOOLS))

from bench import hostprobe, memcgroup  # noqa: E402
from bench import llamacpp as llama  # noqa: E402

_SPIN = """
import threading, time
end = time.time() + 20
def spin():
    while time.time() < end:
        pass
threads = [threading.Thread(target=spin) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
"""
_READ = """
import sys
for path in sys.argv[1:]:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
"""


def llama_step(a: argparse.Namespace, cap: int) -> dict:
    cmd = [str(a.llama_build / "bin" / "llama-bench"), "-m", str(a.gguf), "-t", "2", "-r", "1", "-o", "json",
           "--progress", "-p", "0", "-n", str(a.llama_tokens), *a.llama_args.split()]
    run, _ = llama._bench_once(cmd, a.gguf.resolve(), cap, evict=True, timeout=600)
    return asdict(run)


def ours_step(a: argparse.Namespace, cap: int) -> dict:
    from bench import unified

    ns = argparse.Namespace(model=a.model, quant_model=a.model, routing="sampled", tokens=a.tokens,
                            margin_mib=384, predictor_file=None, trace=None)
    strategy = a.strategy.removeprefix("q:")  # --model is already the directory the strategy runs on
    row = unified.run_trial(ns, strategy, cap, sorted(a.model.glob("*.safetensors")), 1000)
    return {k: row.get(k) for k in ("strategy", "decode_tokens_per_s", "decode_read_bytes_per_token", "error",
                                    "peak_cgroup_bytes")}


def plain_step(cmd: list[str], a: argparse.Namespace, cap: int) -> dict:
    shards = sorted(a.model.glob("*.safetensors"))
    run = memcgroup.run_capped(cmd, cap, evict=shards, capture_output=True, timeout=600)
    return {"returncode": run.returncode, "read_bytes": run.read_bytes, "wall_s": round(run.wall_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-build", type=Path, required=True)
    ap.add_argument("--llama-tokens", type=int, default=16)
    ap.add_argument("--llama-args", default="--repack 0")
    ap.add_argument("--model", type=Path, required=True, help="our checkpoint for the `ours` and `read` steps")
    ap.add_argument("--strategy", default="q:popularity")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--cap-of", type=Path, required=True, help="the checkpoint whose size the cap is a share of")
    ap.add_argument("--cap", type=float, default=0.4, help="share of --cap-of's bytes; 0 = no cap")
    ap.add_argument("--sequence", required=True)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    whole = sum(p.stat().st_size for p in a.cap_of.glob("*.safetensors"))
    cap = int(a.cap * whole) if a.cap else None
    steps = []
    for step in a.sequence.split(","):
        before = hostprobe.snapshot()
        t0 = time.time()
        if step == "llama":
            out = llama_step(a, cap)
        elif step == "ours":
            out = ours_step(a, cap)
        elif step == "read":
            out = plain_step([sys.executable, "-c", _READ, *map(str, sorted(a.model.glob("*.safetensors")))], a, cap)
        elif step == "spin":
            out = plain_step([sys.executable, "-c", _SPIN], a, cap)
        elif step.startswith("sleep"):
            time.sleep(float(step.removeprefix("sleep")))
            out = {}
        else:
            ap.error(f"unknown step {step!r}")
        row = {"step": step, "at": time.strftime("%H:%M:%S", time.gmtime(t0)), **out,
               "host_over_step": hostprobe.delta(before, hostprobe.snapshot())}
        steps.append(row)
        brief = {k: row.get(k) for k in ("step", "at", "tok_s", "samples_ts", "decode_tokens_per_s", "cpu_s",
                                         "to_timed_s", "resident_at_timed_start", "resident_at_exit",
                                         "timed_read_bytes", "wall_s")}
        host = row.get("host") or row["host_over_step"]
        brief.update({k: host.get(k) for k in ("cpu_share.steal", "cpu_share.iowait", "cpu_share.idle",
                                                "vm.pgmajfault", "vm.pgscan_direct", "vm.compact_stall",
                                                "loadavg_1m")})
        print(json.dumps(brief), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                      time.gmtime()), "cpus": os.cpu_count(), "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
