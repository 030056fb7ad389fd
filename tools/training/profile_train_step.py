"""Where does a training step of the demo model spend its time? GPU-bound images/s per bucket, without the loader.

    python tools/training/profile_train_step.py [--sides 448,1056] [--token-budget 160000] [--steps 10] [--device cuda]

One batch per bucket is made in-process, then each bucket runs `--steps` plain steps and (on CUDA) as many CUDA
graph replays of the same step (tools/training/train_fast.py), timed with CUDA events; a profiler table of one plain
step follows. On CPU (`--device cpu`, plain only) it checks that the script runs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_data as D  # noqa: E402
import train_demo as T  # noqa: E402
import train_fast as F  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", default=str(T.TRAINED_DEMO_DIR))
    parser.add_argument("--sides", default="448,1056")
    parser.add_argument("--token-budget", type=int, default=160_000)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    model, processor, _ = T.load_init(args.init, dev)
    model.train()
    encoder = D.TurnEncoder(processor)
    sides = tuple(int(s) for s in args.sides.split(","))
    buckets = D.make_buckets(sides, args.token_budget, args.slots, 24, len(encoder.prefix))
    aux = F.AuxiliaryHead(model.config.text_config.hidden_size).to(dev)
    fast = F.FastModel(model, encoder, dev, aux)
    params = list(model.parameters()) + list(aux.parameters())
    lr = torch.tensor(1e-4, device=dev) if cuda else None
    opt = torch.optim.AdamW(params, lr=lr if cuda else 1e-4, fused=cuda, capturable=cuda)
    stream = D.BatchStream(D.StreamConfig(0, buckets), processor)
    for mode in ("plain", "graph") if cuda else ("plain",):
        runner = F.StepRunner(fast, params, opt, lr, mode)
        for index, bucket in enumerate(buckets):
            batch = {k: v.to(dev) for k, v in stream.batch(random.Random(index), bucket).items()}
            for _ in range(2):  # warm-up (and, for graphs, the capture)
                runner.step(index, bucket, batch)
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            for _ in range(args.steps):
                runner.step(index, bucket, batch)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / args.steps
            else:
                ms = (time.perf_counter() - t) / args.steps * 1000
            rate = bucket.batch / ms * 1000
            print(f"{mode:5s} {bucket.name:>9s} x{bucket.batch:<4d} {ms:8.1f} ms/step {rate:8.0f} img/s")
    if cuda:
        bucket = buckets[-1]
        runner = F.StepRunner(fast, params, opt, lr, "plain")
        batch = {k: v.to(dev) for k, v in stream.batch(random.Random(0), bucket).items()}
        runner.step(len(buckets) - 1, bucket, batch)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            runner.step(len(buckets) - 1, bucket, batch)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
