#!/usr/bin/env python3
"""What inductor makes of one decode layer (kernels/decode_layer.py), at 30B-A3B shapes: the generated wrapper
code of the compiled `attend` and `route`, and the lines of it that launch something other than a fused kernel.

Run 11's profile of the compiled decode token (docs/decode-on-device.md) counts ~19 kernels a layer, among them
one `multi_tensor_apply` and one `memcpy_post` a layer, traced since to inductor's handling of inputs it compiled
as aligned (torch/_inductor/utils.py `copy_misaligned_inputs`: the miss flag of layer m, a bool at byte m, is
cloned before the call and copied back after). This compiles both functions on the given device as the decoder
does (on layer 0's rows), writes inductor's output code under --out, prints every wrapper line that calls a copy,
a foreach op, an extern kernel or a Triton launch, and on CUDA counts the kernels of one `route` call on layer
3's rows laid out as before (packed: cloned and copied back) and as now (decode_layer.aligned_rows).

    python3 tools/device/inductor_code.py --out $OUT/inductor      # CUDA (the device tool)
    python3 tools/device/inductor_code.py --device cpu --out /tmp/i  # the same on the CPU (C++ kernels)
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.kernels.decode_layer import AttentionShape, aligned_rows, make_attend, make_route  # noqa: E402

LAUNCH = re.compile(r"copy_|foreach|extern_kernels|\.run\(|memcpy|aten\.|torch\.ops\.")


class CodeCapture(logging.Handler):
    """Keeps what inductor logs under `output_code`: the generated module of each compiled graph."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "def call(" in text:
            self.modules.append(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=1536)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    torch._logging.set_logs(output_code=True)
    capture = CodeCapture()
    logging.getLogger("torch._inductor.graph.__output_code").addHandler(capture)
    logging.getLogger("torch._inductor.codecache.__output_code").addHandler(capture)

    dev, bf = torch.device(args.device), torch.bfloat16
    h, heads, kv, d = args.hidden, args.heads, args.kv_heads, args.head_dim
    shape = AttentionShape(heads, kv, d, d**-0.5, 1e-6, args.top_k)
    g = torch.Generator(device="cpu").manual_seed(0)

    def weight(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(dev, bf)

    qkv = weight(heads * d + 2 * kv * d, h)  # stacked, as FusedLayers passes it when compiling
    attend = torch.compile(make_attend(shape), dynamic=False, fullgraph=True)
    route = torch.compile(make_route(args.top_k), dynamic=False, fullgraph=True)
    experts = torch.randn(args.top_k, h, generator=g).to(dev)
    hidden = torch.randn(1, 1, h, generator=g).to(dev, bf)
    cos, sin = (torch.randn(1, 1, d, generator=g).to(dev, bf) for _ in range(2))
    keys, values = (torch.zeros(1, kv, args.capacity, d, device=dev, dtype=bf) for _ in range(2))
    lengths = aligned_rows(2, torch.long, dev)  # a layer's length is a one-element view, as in the decoder
    lengths.copy_(torch.tensor([5, 7]))
    positions = torch.arange(args.capacity, device=dev)
    normed = attend(experts, hidden, cos, sin, keys, values, lengths[0:1], positions, weight(h), qkv,
                    qkv[heads * d : heads * d + kv * d], qkv[heads * d + kv * d :], weight(h, heads * d),
                    weight(d), weight(d), weight(h))  # fmt: skip
    table = torch.arange(args.experts, device=dev, dtype=torch.int32)
    routing = torch.zeros(4, args.top_k, dtype=torch.long, device=dev)  # the token's rows; a layer writes one
    missed = torch.zeros(4, dtype=torch.bool, device=dev)  # packed, as before run 12: only row 0 is aligned
    router = weight(args.experts, h)
    route(normed.view(1, h), router, table, routing[0], missed[0])  # compiled on layer 0's rows
    if dev.type == "cuda":
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        for layout, flags in (("packed", missed), ("aligned", aligned_rows(4, torch.bool, dev))):
            route(normed.view(1, h), router, table, routing[3], flags[3])
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                route(normed.view(1, h), router, table, routing[3], flags[3])
                torch.cuda.synchronize()
            names = [e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"]
            print(f"route on layer 3's rows, {layout}: {len(names)} kernels: {names}")

    for name, text in zip(("attend", "route"), capture.modules, strict=False):
        (args.out / f"{name}.py").write_text(text)
        body = text[text.index("def call(") :]
        lines = [line.strip() for line in body.splitlines()]
        calls = [line for line in lines if LAUNCH.search(line) and not line.startswith(("#", "assert"))]
        print(f"== {name}: {len(calls)} launches other than plain buffer handling")
        for line in calls:
            print("   ", line[:160])
    print(f"{len(capture.modules)} compiled modules written under {args.out}")
    return 0 if len(capture.modules) >= 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
