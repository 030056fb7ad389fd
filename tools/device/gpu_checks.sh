#!/usr/bin/env bash
# Run on the GPU server (device tool): correctness of the CUDA paths against transformers, then quick timings.
# Usage there: bash tools/device/gpu_checks.sh   (expects .whl/ carried with the transformers wheel we test against)
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.get_device_name(0))'
python3 -m pytest -q -p no:cacheprovider tests/test_engine_equivalence.py -k cuda 2>&1 | tee "${OUT:-/tmp}/gpu_checks.log"
# quantized experts (issue 16): kernels, then the engine's quantized slot pool, graphs and timings (~2-3 min)
python3 tools/device/quant_checks.py --out "${OUT:-/tmp}/quant.json" 2>&1 | tail -n 40
python3 tools/device/quant_engine_checks.py --out "${OUT:-/tmp}/quant_engine.json" 2>&1 | tail -n 40
