#!/usr/bin/env bash
# On the GPU server (device tool): the CUDA paths against transformers (GPU slot pool with CUDA graphs on and off,
# the pinned host tier, predictors), the quantized kernels, then (optionally) build the benchmark checkpoint.
#   bash tools/device/gpu_checks.sh [--build-bench]     (carry .whl: the transformers wheel we test against)
# Each step has its own time limit and failure does not stop the next; the logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1
# the native page-cache helper (pread pool without the GIL); the Python fallback serves if this fails
python3 setup.py -q build_ext --inplace > "$OUT/native-build.log" 2>&1 || echo "native helper not built (see native-build.log)"
python3 -c 'import torch, transformers; from vismmoe_edge.experts import pagecache as pc
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0), "page cache backend", pc.backend())'
echo "== CUDA equivalence against transformers"
timeout 260 python3 -m pytest -q -p no:cacheprovider -rA tests/test_engine_equivalence.py -k cuda 2>&1 | tail -40 | tee "$OUT/gpu_checks.log"
echo "== quantized kernels"
timeout 150 python3 tools/device/quant_checks.py --out "$OUT/quant.json" 2>&1 | tail -30
echo "== the engine's quantized slot pool (graphs, fetch paths, transformers on the dequantized file)"
timeout 200 python3 tools/device/quant_engine_checks.py --out "$OUT/quant_engine.json" 2>&1 | tail -40
if [ "${1:-}" = "--build-bench" ]; then
    echo "== the benchmark checkpoint (48 layers of Qwen3-VL-30B-A3B geometry)"
    timeout $((560 - ($(date +%s) - T0))) python3 tools/bench/discrete.py --out-dir /tmp/bench --build-only 2>&1 | tail -5
    df -h /tmp | tail -1
fi
echo "gpu_checks.sh took $(( $(date +%s) - T0 )) s"
