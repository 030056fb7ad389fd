#!/usr/bin/env bash
# On the GPU server (device tool), a short call (~5 minutes on a fresh machine) for when little device time is
# left: the code's correctness on CUDA without the 61 GB checkpoint or any timing.
#   - the read-in-place equivalence checks with compiled layers (decode_checks.py --compile --only-mapped): the
#     device token against transformers under the near-tie rule, at 25% with the token embedding in host memory;
#   - the CUDA equivalence suite once (tests/test_engine_equivalence.py and tests/test_device_decode.py, -k cuda).
# Carry `.whl`; tar $OUT after it.
#   bash tools/device/short_checks.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
TOTAL=${TOTAL:-300}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace > "$OUT/native-build.log" 2>&1 || echo "native helper not built"
echo "== read-in-place equivalence, compiled layers"
timeout "${CHECK_S:-150}" python3 tools/device/decode_checks.py --compile --only-mapped --skip-layer \
    --out "$OUT/mapped_checks.json" 2>&1 | grep "^\[" | tail -8
left=$((TOTAL - ($(date +%s) - T0)))
echo "== the CUDA equivalence suite once, $left s left"
timeout "$left" python3 -m pytest -q -x -p no:cacheprovider tests/test_engine_equivalence.py \
    tests/test_device_decode.py -k cuda > "$OUT/cuda_suite.log" 2>&1
echo "suite: exit $? ($(tail -1 "$OUT/cuda_suite.log"))"
echo "short_checks.sh took $(( $(date +%s) - T0 )) s"
