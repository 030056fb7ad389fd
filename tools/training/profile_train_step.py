"""Where does a training step of the demo model spend its time on the GPU? (device tool; prints tables)

    python tools/training/profile_train_step.py [--batch 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import train_demo as T  # noqa: E402
from transformers import Qwen3VLMoeForConditionalGeneration  # noqa: E402


def timed(step, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    stream = iter(T.TrainStream(0, 10))
    samples = [next(stream) for _ in range(args.batch)]
    proc = T.build_processor()
    batch = T.collate(samples, proc.tokenizer.pad_token_id)
    batch = {k: v.to(dev) for k, v in batch.items()}
    batch["pixel_values"] = T.normalize_pixels(batch["pixel_values"])
    print("tokens", batch["input_ids"].shape, "patches", batch["pixel_values"].shape)
    for dtype in (torch.float32, torch.bfloat16):
        for impl in ("grouped_mm", "batched_mm"):
            model = Qwen3VLMoeForConditionalGeneration(T.model_config(proc.tokenizer)).to(dev, dtype).train()
            model.set_experts_implementation(impl)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            b = dict(batch, pixel_values=batch["pixel_values"].to(dtype))

            def step(model=model, b=b, opt=opt):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(**b, output_router_logits=True)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            def vision_only(model=model, b=b):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model.model.visual(b["pixel_values"], grid_thw=b["image_grid_thw"])
                pooled = out.pooler_output
                (pooled if isinstance(pooled, torch.Tensor) else torch.cat(pooled)).float().sum().backward()

            try:
                for _ in range(3):
                    step()
                ms = timed(step, 5)
                vis = timed(vision_only, 5)
                print(f"{dtype} {impl}: step {ms:.1f} ms, vision fwd+bwd {vis:.1f} ms")
            except Exception as exc:  # noqa: BLE001
                print(f"{dtype} {impl}: failed {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if dtype == torch.float32 and impl == "grouped_mm":
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
