#!/usr/bin/env bash
# On the GPU server (device tool), one call: issue 6's and 7's H200 measurements, in priority order, each step
# time-boxed and writing to $OUT as it finishes (a step cut short loses only itself).
#   1. compressor latency (selectors + the saliency attention pass) on CUDA, and on this host's CPU;
#   2. predictor latency per call at the demo model's and at Qwen3-VL-30B-A3B's geometry;
#   3. calibration of the trained demo model on the GPU (train split with and without compression; test and
#      shifted splits), the predictor trained on it (both forms, the better kept) and exported to ONNX;
#   4. the Table-4 ablation on the discrete path (tier gpu) with that predictor;
#   5. recall of the learned predictor against the simple ones on test and shifted.
#   bash tools/device/compression_and_predictor.sh        (carry .whl: the transformers wheel we test against)
#   CODE=DIR takes the package and tools from DIR (a clean snapshot) instead of the working tree.
set -uo pipefail
CODE=${CODE:-$PWD}
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
CLI=(python3 -m vismmoe_edge.cli)
M=vismmoe_edge/demo_model
C=/tmp/cal
mkdir -p $C
python3 -c 'import torch, transformers, onnxruntime as ort; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0), "ort", ort.__version__, ort.get_available_providers())'
timeout 70 python3 $CODE/tools/bench/compressor.py --n 1089 --runs 200 --attn-runs 30 --json "$OUT/bench-compressor-h200.json"
timeout 30 python3 $CODE/tools/bench/predictor.py --layers 8 --experts 32 --hidden 192 --runs 2000 --json "$OUT/bench-predictor-demo-h200.json"
timeout 30 python3 $CODE/tools/bench/predictor.py --layers 48 --experts 128 --hidden 2048 --runs 2000 --json "$OUT/bench-predictor-30b-h200.json"
common=(--model $M --max-new-tokens 8 --memory-budget 100% --pinned-layers 2 --device cuda)
timeout 70 "${CLI[@]}" calibrate "${common[@]}" --split train --limit 120 --out $C/train-none.npz
timeout 70 "${CLI[@]}" calibrate "${common[@]}" --split train --limit 120 --compressor affinity --keep-ratio 0.7 --out $C/train-affinity.npz
timeout 40 "${CLI[@]}" calibrate "${common[@]}" --split test --limit 60 --out $C/test.npz
timeout 40 "${CLI[@]}" calibrate "${common[@]}" --split shifted --limit 60 --out $C/shifted.npz
timeout 60 "${CLI[@]}" train-predictor --data $C/train-none.npz --data $C/train-affinity.npz --out $C/pred --form both
timeout 20 "${CLI[@]}" export-predictor --checkpoint $C/pred/predictor.pt --out $C/pred/vismmoe-predictor.onnx
tar -C $C -czf "$OUT/calibration.tgz" .
timeout 100 python3 $CODE/tools/bench/ablation.py --model $M --predictor-file $C/pred/vismmoe-predictor.onnx \
    --device cuda --tier gpu --memory-budget 40% --pinned-layers 2 --prompts 8 --rounds 2 --json "$OUT/ablation-h200.json"
