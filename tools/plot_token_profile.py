"""Where a compiled decode token's GPU time goes, from discrete.py's profiles: one stacked bar per profile (ms a
token by kind of kernel, and the GPU's idle time), with the expert weights' byte bound marked.

    python tools/plot_token_profile.py --out docs/figures/token-profile-h100-run16.png --expert-bound-ms 1.20,0.32 \
        "bf16=docs/results/discrete-compiled-h100-run16.json" \
        "int4 g128=docs/results/discrete-bench-int4-h100-run16.json"

Each FILE's profile of the compiled resident token (sampled routing) is drawn as the profile reports it: a
token's average over the profiled tokens, kernels and wall time alike (so the idle share is the profile's 1 -
busy). The profiled tokens average 0.875 graph launches (7 decode steps for 8 tokens), so a byte bound given per
decode step is drawn at that fraction.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (label, does a kernel name belong): first match wins; lm_head and sampling run once a token
KINDS = (
    ("expert GEMVs", lambda n: n.startswith("_gemv")),
    ("lm_head, sampling", lambda n: "384x8" in n or "SoftMax" in n or "radix_sort" in n or "ArgMax" in n),
    ("qkv, o_proj", lambda n: n.startswith("nvjet") or n.startswith("_dense_gemv")),
    ("router", lambda n: n.startswith("_route")),
    ("attention", lambda n: n.startswith("_split") or n.startswith("_combine")),
    ("norms, rotary, KV writes", lambda n: n.startswith("triton_")),
)
COMPILED = "every expert resident, device path, compiled layers"


def token_profile(path: Path) -> dict:
    data = json.loads(path.read_text())
    profile = next(p for p in data["profiles"] if p["engine"] == COMPILED and p.get("routing") == "sampled")
    ms = {label: 0.0 for label, _ in KINDS} | {"other kernels": 0.0}
    for name, total_us, _count in profile["gpu_top"]:
        label = next((lb for lb, match in KINDS if match(name)), "other kernels")
        ms[label] += total_us / 1e3
    wall = profile["wall_ms_per_token"]
    ms["GPU idle"] = max(0.0, wall - sum(ms.values()))
    launches = profile["graph_launches_per_token"] or 1.0
    return {"ms": ms, "wall": wall, "busy": profile["compute_busy"], "launches": launches}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("profiles", nargs="+", help="LABEL=discrete.py JSON")
    ap.add_argument("--expert-bound-ms", default="",
                    help="each profile's expert byte bound a decode step, comma-separated (a tick)")  # fmt: skip
    args = ap.parse_args(argv)
    bounds = [float(b) for b in args.expert_bound_ms.split(",") if b]
    rows = [(label, token_profile(Path(path))) for label, path in (p.split("=", 1) for p in args.profiles)]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(rows)))
    colors = plt.get_cmap("tab10").colors
    for y, (_, prof) in enumerate(rows):
        left = 0.0
        for i, (kind, ms) in enumerate(prof["ms"].items()):
            color = "lightgrey" if kind == "GPU idle" else colors[i % len(colors)]
            ax.barh(y, ms, left=left, color=color, label=kind if y == 0 else None, edgecolor="white")
            left += ms
        ax.text(left + 0.03, y, f"{prof['wall']:.2f} ms, busy {prof['busy']:.0%}", va="center", fontsize=8)
        if y < len(bounds):
            ax.plot([bounds[y] * prof["launches"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("ms a profiled token (black tick: the expert weights' byte bound)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.2))
    ax.invert_yaxis()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(json.dumps({label: {k: round(v, 3) for k, v in prof["ms"].items()} for label, prof in rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
