#!/usr/bin/env python3
"""What tools/device/int4_ncu.sh's Nsight Compute export says, per kernel, in one small JSON: the metrics that
tell a kernel's limit (duration, DRAM throughput, issued IPC, cycles without an eligible warp, occupancy,
registers, instructions executed) and its instruction mix by opcode (from the SASS source page).

    python3 tools/ncu_summary.py OUT_DIR --json summary.json

OUT_DIR holds gemv_details.csv, gemv_source_<n>.csv and int4_ncu/summary.json (the kernels' names and configs,
in launch order)."""

from __future__ import annotations

import argparse
import collections
import csv
import json
from pathlib import Path

METRICS = ("Duration", "DRAM Throughput", "Issued Ipc Active", "No Eligible", "Warp Cycles Per Issued Instruction",
           "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread", "Executed Instructions")  # fmt: skip


def number(text: str) -> float:
    return float(text.replace(",", ""))


def details(path: Path) -> dict[int, dict]:
    """Launch id -> {metric: value, 'grid': ...} from ncu's details page."""
    out: dict[int, dict] = collections.defaultdict(dict)
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["Metric Name"] in METRICS:
                unit = row["Metric Unit"]
                out[int(row["ID"])][f"{row['Metric Name']} ({unit})" if unit else row["Metric Name"]] = number(
                    row["Metric Value"]
                )
                out[int(row["ID"])]["grid"] = row["Grid Size"]
    return out


def opcode_mix(path: Path, top: int = 12) -> dict[str, float]:
    """Share of executed warp instructions by opcode (predicates and modifiers dropped)."""
    with path.open() as f:
        rows = list(csv.reader(f))[1:]  # the first line names the kernel
    header, counts = rows[0], collections.Counter()
    for row in rows[1:]:
        entry = dict(zip(header, row, strict=False))
        words = entry["Source"].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        counts[op.split(".")[0]] += int(entry["Instructions Executed"] or 0)
    total = sum(counts.values())
    return {op: round(n / total, 4) for op, n in counts.most_common(top)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    kernels = json.loads((args.out_dir / "int4_ncu" / "summary.json").read_text())
    metrics = details(args.out_dir / "gemv_details.csv")
    result = {}
    for label, info in sorted(kernels.items(), key=lambda kv: kv[1]["launch_order"]):
        n = info["launch_order"]
        source = args.out_dir / f"gemv_source_{n}.csv"
        result[label] = {"config": info["config"], **metrics.get(n, {}),
                         "opcode_mix": opcode_mix(source) if source.exists() else None}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for label, row in result.items():
        print(label, {k: v for k, v in row.items() if k != "opcode_mix"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
