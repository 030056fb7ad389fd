#!/usr/bin/env python3
"""GPU checks of the integrated-GPU tiers (experts/tiers/igpu_slots.py, igpu_registered.py), one JSON summary.

    python3 tools/device/igpu_checks.py --out $OUT/igpu.json              # ~2 min on an H200
    python3 tools/device/igpu_checks.py --out $OUT/igpu.json --bench      # + the 30B-geometry benchmark (~3 min
                                                                          #   plus the checkpoint build, once)
Checks, each on its own (a failure is recorded with its error and the run goes on; exit status 1 if any failed):
- device: the attributes the tiers rest on (integrated, map host memory, pageable access, host register,
  read-only register, registered memory at its host address);
- host memory: slots pinned with cudaHostRegister in 1 GiB pieces, viewed as CUDA tensors at the host address
  (`__cuda_array_interface__`), a GEMV on the view equal to one on a device copy; pinning 2 GiB by pieces vs one
  cudaHostAlloc, timed;
- registration: READ_ONLY cudaHostRegister of ranges of a MAP_SHARED, PROT_READ file mapping: kernels read them,
  /proc/self/smaps shows no anonymous copy, FADV_DONTNEED cannot drop them while registered, an evicted
  (unregistered, dropped) range leaves the page cache; register/unregister of 9 MiB timed;
- slot bytes on CUDA: every host write of a miss lands in its slot, once per byte, no torch copy, no page cache;
- equivalence: `--tier unified --device cuda` (the default variant, slots) and `--tier unified-registered`, greedy
  tokens identical to transformers' own model (on the GPU) at 100%, 25% and 10% budgets, text and one and two
  images, bf16 (hub layout, as upstream checkpoints ship) and fp32 (transformers-5 layout); bytes read and copied
  per generated token for each;
- the CLI: `run --tier unified --device cuda` and `run --device cuda --profile agx-orin-64gb--maxn` (the command
  issue 17 found failing) on the demo model;
- with --bench: tools/bench/discrete.py with the discrete tier (LRU), both unified tiers and Accelerate at
  20 GiB on the Qwen3-VL-30B-A3B-geometry checkpoint; the faster unified tier is reported as `faster_variant`
  (make it hardware/gpu_access.DEFAULT_IGPU_TIER).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.hf_reference import (  # noqa: E402
    NEW_TOKENS,
    PROMPTS,
    hf_kwargs,
    near_tie_divergence,
    teacher_forced_logits,
)
from tools.device.checks import Checks  # noqa: E402
from vismmoe_edge.experts import pagecache  # noqa: E402
from vismmoe_edge.experts.page_ranges import PAGE_SIZE  # noqa: E402
from vismmoe_edge.experts.tiers import slot_fill  # noqa: E402
from vismmoe_edge.hardware import cudart, gpu_access  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
BUDGETS = (("100%", 1), ("25%", 1), ("10%", 0))  # (budget, pinned layers): 10% of 10 layers has no room to pin
VARIANTS = ("unified", "unified-registered")  # --tier unified is the default variant (slots)
DTYPES = ((torch.bfloat16, "hub"), (torch.float32, "v5"))


def timed(fn: Callable[[], Any], sync: bool = True) -> float:
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start


# ---- device and memory -----------------------------------------------------------------------------------------
def check_device() -> dict[str, Any]:
    access = gpu_access.probe(0)
    assert access is not None
    return {"ok": access.slot_refusal() is None, "access": access.as_dict(),
            "registration_refusal": access.registration_refusal()}  # fmt: skip


def check_host_memory() -> dict[str, Any]:
    from vismmoe_edge.experts.tiers.host_memory import HostMemory

    rt = cudart.runtime()
    n, k = 1536, 2048  # one Qwen3-VL-30B-A3B gate_up matrix
    mem = HostMemory(n * k * 2, runtime=rt)
    host = mem.cpu_view(0, n * k * 2).view(torch.bfloat16).view(n, k)
    host.copy_(torch.randn(n, k, dtype=torch.bfloat16))
    view = mem.device_view(0, n * k * 2, torch.device("cuda")).view(torch.bfloat16).view(n, k)
    x = torch.randn(k, dtype=torch.bfloat16, device="cuda")
    same = torch.equal(view @ x, host.to("cuda") @ x)
    times = {}
    for label, make in (("register_1gib_pieces", lambda: HostMemory(2 * GIB, runtime=rt)),
                        ("cuda_host_alloc", lambda: _host_alloc(rt, 2 * GIB))):  # fmt: skip
        start = time.perf_counter()
        m = make()
        times[f"pin_2gib_{label}_s"] = round(time.perf_counter() - start, 3)
        m.close()
    return {"ok": same and view.data_ptr() == mem.device_address, "same_pointer": view.data_ptr() == mem.address,
            "gemv_equal_to_device_copy": same, "how": mem.how, **times}  # fmt: skip


class _Alloc:
    def __init__(self, rt: cudart.CudaRuntime, address: int) -> None:
        self.rt, self.address = rt, address

    def close(self) -> None:
        self.rt.free_host(self.address)


def _host_alloc(rt: cudart.CudaRuntime, nbytes: int) -> _Alloc:
    err, address = rt.host_alloc(nbytes, cudart.ALLOC_PORTABLE | cudart.ALLOC_MAPPED)
    if err:
        raise RuntimeError(rt.error_string(err))
    ctypes.memset(address, 0, nbytes)  # what HostMemory does to it: touch every page
    return _Alloc(rt, address)


def check_registration(tmp: Path) -> dict[str, Any]:
    from vismmoe_edge.experts.tiers.host_memory import DeviceArray
    from vismmoe_edge.experts.tiers.igpu_registered import SegmentRegistry, mapping_anonymous_bytes, segments

    path = tmp / "shard.bin"
    data = torch.randint(0, 255, (64 * MIB,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    pagecache.evict_file(path)
    rt = cudart.runtime()
    mf = pagecache.MappedFile(path)  # MAP_SHARED, PROT_READ
    registry = SegmentRegistry(rt, {path: mf.base_address})
    a_range, b_range = (1000, 9 * MIB), (1000 + 9 * MIB, 9 * MIB)  # neighbours: they share a page
    pagecache.prefetch_pread(mf, [a_range, b_range])
    a, b = segments(path, *a_range, mf.size), segments(path, *b_range, mf.size)
    t_register = timed(lambda: registry.acquire(a), sync=False)
    registry.acquire(b)
    views = []
    for off, n in (a_range, b_range):
        views.append(torch.as_tensor(DeviceArray(mf.base_address + off, n, mf), device="cuda"))
    sums_ok = all(int(v.sum(dtype=torch.int64)) == int(data[o : o + n].sum(dtype=torch.int64))
                  for v, (o, n) in zip(views, (a_range, b_range), strict=True))  # fmt: skip
    anonymous = mapping_anonymous_bytes(path)
    os.posix_fadvise(mf.fd, a_range[0], a_range[1], os.POSIX_FADV_DONTNEED)  # registered: the pin keeps the pages
    kept_while_registered = pagecache.resident_fraction(mf, [a_range])
    del views
    t_unregister = timed(lambda: [pagecache.release(mf, [(o, min(n, mf.size - o))], "dontneed")
                                  for _, o, n in registry.release(a)], sync=False)  # fmt: skip
    interior = (a_range[0] + PAGE_SIZE, a_range[1] - 2 * PAGE_SIZE)  # the pages a shares with nobody
    left_after_evict = pagecache.resident_fraction(mf, [interior])
    b_resident = pagecache.resident_fraction(mf, [b_range])
    registry.release(b)
    mf.close()
    return {
        "ok": sums_ok and anonymous == 0 and left_after_evict == 0.0 and b_resident == 1.0,
        "kernels_read_registered_ranges": sums_ok,
        "smaps_anonymous_bytes": anonymous,
        "resident_after_fadvise_while_registered": kept_while_registered,
        "resident_after_evict": left_after_evict,
        "neighbour_still_resident": b_resident,
        "register_9mib_ms": round(t_register * 1e3, 3),
        "unregister_and_drop_9mib_ms": round(t_unregister * 1e3, 3),
    }


# ---- slot bytes on CUDA ---------------------------------------------------------------------------------------
def check_slot_bytes(model_dir: Path) -> dict[str, Any]:
    from vismmoe_edge.checkpoint import TORCH_DTYPES
    from vismmoe_edge.checkpoint_info import inspect_checkpoint
    from vismmoe_edge.experts.store import ExpertStore, ShardFiles
    from vismmoe_edge.experts.tiers.igpu_slots import UnifiedSlotTier

    writes: list[tuple[int, int]] = []

    def reader(fd: int, ranges, dests) -> None:
        writes.extend((d, n) for (_, n), d in zip(ranges, dests, strict=True))
        slot_fill.default_reader(fd, ranges, dests)

    info = inspect_checkpoint(model_dir)
    store = ExpertStore(info.catalogue, ShardFiles(), TORCH_DTYPES[info.catalogue.dtype], torch.device("cuda"))
    tier = UnifiedSlotTier(store, 8, runtime=cudart.runtime(), reader=reader)
    for shard in sorted(model_dir.glob("*.safetensors")):
        tier.filler.shard(shard)
        pagecache.evict_file(shard)
    copies: list[int] = []
    original = torch.Tensor.copy_

    def counting(self, *a, **k):  # type: ignore[no-untyped-def]
        copies.append(1)
        return original(self, *a, **k)

    problems, weights = [], {}
    keys = [(info.catalogue.moe_layers[i % 3], 2 * i) for i in range(6)]
    torch.Tensor.copy_ = counting  # type: ignore[method-assign]
    try:
        for slot, key in enumerate(keys):
            n0 = len(writes)
            weights[key] = tier.fetch(key, slot)
            spans = tier.slot_ranges(slot)
            mine = writes[n0:]
            if not all(any(a <= d and d + n <= a + s for a, s in spans) for d, n in mine):
                problems.append(f"{key}: a write outside its slot")
            if sum(n for _, n in mine) != info.catalogue.expert(*key).nbytes:
                problems.append(f"{key}: {sum(n for _, n in mine)} bytes written")
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]
    resident = 0
    for key in keys:
        for p in info.catalogue.expert(*key).parts:
            with pagecache.MappedFile(p.shard) as mf:
                resident += pagecache.resident_pages(mf, [(p.offset, p.nbytes)])[0]
    equal = all(torch.equal(weights[k].gate_up, store.load(*k).gate_up) for k in keys)  # read last: faults read around
    fills = tier.fill_stats
    return {
        "ok": not problems and not copies and resident == 0 and equal,
        "problems": problems,
        "torch_copies_during_fetch": len(copies),
        "resident_pages_after_fill": resident,
        "gpu_view_equals_weights": equal,
        "direct_bytes": fills.direct_bytes,
        "buffered_bytes": fills.buffered_bytes,
        "pool_at_its_host_memory": tier.gate_up.data_ptr() == tier.memory.device_address,
    }


# ---- equivalence ---------------------------------------------------------------------------------------------
def make_images(root: Path) -> list[Path]:
    from PIL import Image, ImageDraw

    paths = []
    for i, (w, h) in enumerate([(224, 160), (128, 192)]):  # as tests/conftest.py draws them
        img = Image.new("RGB", (w, h), (30 + 100 * i, 120, 200 - 80 * i))
        draw = ImageDraw.Draw(img)
        draw.ellipse((10, 10, 10 + w // 3, 10 + h // 3), fill=(220, 30, 30))
        draw.rectangle((w // 2, h // 2, w - 8, h - 8), fill=(20, 20, 220))
        paths.append(root / f"img{i}.png")
        img.save(paths[-1])
    return paths


def references(model_dir: Path, dtype: torch.dtype, images: list[Path], device: str) -> dict[str, tuple[Any, list]]:
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor
    from vismmoe_edge.prompt import encode_prompt, load_image

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
    model = model.to(device).eval()
    processor = load_qwen3_vl_processor(model_dir)
    refs = {}
    for name, (prompt, n_images) in PROMPTS.items():
        inputs = encode_prompt(processor, prompt, [load_image(p) for p in images[:n_images]])
        kwargs = {k: v.to(device) for k, v in hf_kwargs(inputs).items()}
        with torch.no_grad():
            out = model.generate(**kwargs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        # per-step logits: a mismatch is judged by the near-tie rule (tests/hf_reference.near_tie_divergence)
        logits = [step[0].float().cpu() for step in out.logits]
        refs[name] = (inputs, out.sequences[0, inputs.num_tokens :].tolist(), logits)
    del model
    return refs


def check_equivalence(model_dir: Path, refs: dict, variant: str, budget: str, pinned: int, device: str) -> dict:
    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    engine = vismmoe_edge.load(model_dir, memory_budget=budget, pinned_layers=pinned, device=device, tier=variant)
    pipeline = engine.experts.pipeline
    tier = pipeline.tier
    mismatches, generated = [], 0
    near_ties = []
    for name, (inputs, tokens, ref_logits) in refs.items():
        result = engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=NEW_TOKENS,
                                                                    min_new_tokens=NEW_TOKENS))  # fmt: skip
        generated += len(result.token_ids)
        if result.token_ids != tokens:
            static = engine.uses_static_decode()
            forced = [t.cpu() for t in teacher_forced_logits(engine, inputs, tokens, static=static)]
            d = near_tie_divergence(result.token_ids, tokens, ref_logits, forced)
            entry = {"prompt": name, "ours": result.token_ids, "transformers": tokens, "first_difference": d.step,
                     "reference_top2_margin": d.margin, "teacher_forced_logit_difference": d.difference,
                     "verdict": d.describe()}  # fmt: skip
            (near_ties if d.accepted else mismatches).append(entry)
    s = pipeline.stats
    fills = getattr(tier, "fill_stats", None)
    moe_layers = len(engine.catalogue.moe_layers)
    expected = {"unified": gpu_access.DEFAULT_IGPU_TIER, "gpu": "gpu-slots", "host": "host-slots"}.get(variant, variant)
    out = {
        "ok": not mismatches and tier.name == expected,  # another name: a fallback (its reason is on stderr)
        "tier": tier.name,
        "static_decode": engine.uses_static_decode(),
        "mismatches": mismatches,
        "near_ties": near_ties,  # accepted: the reference's top-2 margin is below the implementations' difference
        "misses": s.misses,
        "evictions": s.evictions,
        "read_bytes_per_token": s.bytes_read / generated,  # prefill's reads included: tiny prompts
        "cpu_copied_bytes_per_token": (fills.buffered_bytes / generated) if fills else 0,
        "direct_bytes_per_token": (fills.direct_bytes / generated) if fills else 0,
        "gathered_bytes_per_decode_token": (engine.context.top_k * moe_layers * tier.slot_bytes
                                            if getattr(tier, "pool", None) is not None else 0),  # fmt: skip
        "host_to_device_bytes": 0,  # neither unified tier copies experts to the GPU
    }
    if getattr(tier, "registry", None) is not None:
        out["registered_bytes_at_end"] = tier.registry.registered_bytes
        out["device_gathered_bytes"] = tier.gathered_bytes
    pipeline.close()
    return out


# ---- CLI and benchmark ---------------------------------------------------------------------------------------
def check_cli(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "vismmoe_edge.cli", "run", "--prompt", "What colour is the circle?",
           "--max-new-tokens", "4", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    tail = proc.stderr.strip().splitlines()[-3:]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "stdout": proc.stdout.strip()[:200],
            "stderr_tail": tail}  # fmt: skip


def run_bench(bench_dir: Path, out: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "tools/bench/discrete.py"), "--out-dir", str(bench_dir), "--json", str(out),
           "--strategies", "lru,unified-slots,unified-registered,accelerate", "--repeats", "1",
           "--new-tokens", "8", "--accelerate-tokens", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ,
                          "PYTHONPATH": str(ROOT)})  # fmt: skip
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr.strip()[-1500:]}
    summary = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in summary["results"]}
    speeds = {name: rows[name].get("decode_tokens_per_s") for name in ("unified-slots", "unified-registered")
              if name in rows and "error" not in rows[name]}  # fmt: skip
    faster = max(speeds, key=lambda n: speeds[n]) if len(speeds) == 2 else None
    return {"ok": all("error" not in r for r in summary["results"]), "faster_variant": faster,
            "decode_tokens_per_s": {n: r.get("decode_tokens_per_s") for n, r in rows.items()},
            "summary_file": str(out), "rows": summary["results"]}  # fmt: skip


def equivalence_matrix(
    checks: Checks, tmp: Path, images: list[Path], dtype: torch.dtype, layout: str, variants: tuple, device: str
) -> None:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    if not checks.cuda:  # recorded as skipped, without building anything
        checks.run(f"equivalence {dtype} {layout}", dict)
        return
    model_dir = build_tiny_checkpoint(tmp / f"{layout}-{dtype}", seed=5, dtype=dtype, layout=layout, num_layers=10)
    if device == "cuda" and dtype == torch.bfloat16:
        checks.run("slot bytes on cuda", lambda: check_slot_bytes(model_dir))
    refs: dict[str, Any] = {}
    checks.run(f"transformers reference {dtype}",
               lambda: refs.update(references(model_dir, dtype, images, device)) or {})  # fmt: skip
    if not refs:
        return
    # The discrete tier (host tier on the CPU) over the same compute path: if it differs too, the difference is the
    # batched expert computation's (pool_compute.py), not where the slots live.
    control = "gpu" if device == "cuda" else "host"
    checks.run(f"control: tier {control} 25% {dtype} {layout} = transformers",
               lambda: check_equivalence(model_dir, refs, control, "25%", 1, device))  # fmt: skip
    for variant in variants:
        for budget, pinned in BUDGETS:
            name = f"{variant} {budget} {dtype} {layout} = transformers"
            checks.run(name, lambda v=variant, b=budget, p=pinned: check_equivalence(model_dir, refs, v, b, p, device))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "igpu.json")
    ap.add_argument("--bench", action="store_true", help="also run the 30B-geometry benchmark (discrete.py)")
    ap.add_argument("--bench-dir", type=Path, default=Path("/tmp/vismmoe-bench"))
    ap.add_argument("--bench-timeout", type=float, default=600)
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the equivalence matrix's logic on the CPU")
    args = ap.parse_args(argv)
    checks = Checks(needs_cuda=not args.cpu_dry_run)
    device = "cpu" if args.cpu_dry_run else "cuda"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="igpu-checks-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.cpu_dry_run:
            checks.run("device attributes", check_device)
            checks.run("host memory viewed by the GPU", check_host_memory)
            checks.run("read-only registration of a shared file mapping", lambda: check_registration(tmp))
        images = make_images(tmp)
        variants = ("unified-slots",) if args.cpu_dry_run else VARIANTS
        for dtype, layout in DTYPES:
            equivalence_matrix(checks, tmp, images, dtype, layout, variants, device)
        if not args.cpu_dry_run:
            checks.run("cli: run --tier unified --device cuda", lambda: check_cli(["--tier", "unified",
                                                                                   "--device", "cuda"]))  # fmt: skip
            checks.run("cli: run --device cuda --profile agx-orin-64gb--maxn",
                       lambda: check_cli(["--device", "cuda", "--profile", "agx-orin-64gb--maxn"]))  # fmt: skip
    bench = None
    if args.bench and torch.cuda.is_available():
        bench = checks.run("benchmark at 20 GiB (discrete.py)",
                           lambda: run_bench(args.bench_dir, args.out.with_name("igpu_bench.json"),
                                             args.bench_timeout))  # fmt: skip
    summary = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "default_igpu_tier": gpu_access.DEFAULT_IGPU_TIER,
        "faster_variant": None if bench is None else bench.get("faster_variant"),
        "seconds": round(time.perf_counter() - start, 1),
        "passed": sum(r["status"] == "pass" for r in checks.results),
        "failed": [r["name"] for r in checks.results if r["status"] == "fail"],
        "checks": checks.results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
