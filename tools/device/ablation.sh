#!/usr/bin/env bash
# On the GPU server (device tool): the Table-4 ablation on the discrete path (tier gpu) with the trained demo model.
#   bash tools/device/ablation.sh PREDICTOR.onnx   (carry .whl; CODE=DIR takes the package and tools from DIR)
set -uo pipefail
CODE=${CODE:-$PWD}
predictor=${1:?usage: device_ablation.sh PREDICTOR.onnx}
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
timeout 170 python3 "$CODE/tools/bench/ablation.py" --model vismmoe_edge/demo_model --predictor-file "$predictor" \
    --device cuda --tier gpu --memory-budget 40% --pinned-layers 2 --prompts 8 --rounds 2 --json "$OUT/ablation-h200.json"
