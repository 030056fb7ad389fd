#!/usr/bin/env python3
"""Markdown table of a tools/bench/unified.py JSON result: each strategy against plain mmap and the oracle bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(summary: dict) -> str:
    rows = summary["results"]
    out = [
        "| cap | strategy | decode tok/s (median; trials) | vs plain mmap | vs llama.cpp | oracle time / ours "
        "| read MB / token | Belady MB / token | hit rate | prefill s | peak cgroup GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    caps = sorted({r["cap"] for r in rows if r.get("cap") is not None})
    if any(r.get("cap") is None for r in rows):
        caps.append(None)  # the resident rows (uncapped), ours and llama.cpp's, after the capped ones
    for cap in caps:
        at = [r for r in rows if r.get("cap") == cap]
        cap_text = "none" if cap is None else f"{cap:.0%}"
        mmap = next((r for r in at if r["strategy"] == "plain-mmap" and "error" not in r), None)
        llama = next((r for r in at if r["strategy"].startswith("llama.cpp") and "error" not in r), None)
        bound = next((r for r in at if r["strategy"] == "oracle-bound"), None)
        for r in at:
            if "error" in r:
                out.append(f"| {cap_text} | {r['strategy']} | failed: {r['error'][:80]} | | | | | | | | |")
                continue
            tps = r["decode_tokens_per_s"]
            trials = ", ".join(f"{x:.2f}" for x in r.get("decode_tokens_per_s_all", [])) or "-"
            if r.get("warmup_tokens_per_s"):  # the discarded warm-up trials (unified.py --warmup-trials)
                trials += "; warm-ups " + ", ".join("-" if x is None else f"{x:.2f}" for x in r["warmup_tokens_per_s"])
            vs_mmap = f"{tps / mmap['decode_tokens_per_s']:.2f}x" if mmap else ""
            vs_llama = f"{tps / llama['decode_tokens_per_s']:.2f}x" if llama else ""
            vs_bound = f"{bound['decode_tokens_per_s'] / tps:.2f}" if bound else ""
            read = r.get("decode_read_bytes_per_token")
            belady = r.get("belady_read_bytes_per_token")
            hit = None if r["strategy"] == "plain-mmap" else r.get("hit_rate")  # the kernel decides there
            prefill = r.get("prefill_s")
            peak = r.get("peak_cgroup_bytes")
            out.append(
                f"| {cap_text} | {r['strategy']} | {tps:.2f} ({trials}) | {vs_mmap} | {vs_llama} | {vs_bound} | "
                f"{'' if read is None else f'{read / 1e6:.0f}'} | {'' if belady is None else f'{belady / 1e6:.0f}'} | "
                f"{'' if hit is None else f'{hit:.3f}'} | "
                f"{'' if prefill is None else f'{prefill:.2f}'} | {'' if peak is None else f'{peak / 2**30:.2f}'} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())))
