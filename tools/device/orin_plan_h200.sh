#!/bin/bash
# The Orin Nano plan forced through unified-slots on the H200, and quantized dense weights on CUDA (issue 25).
# One call, <= 8 minutes, results under $OUT:   bash tools/device/orin_plan_h200.sh
# The synthetic proxy has 8 decoder layers (~9.7 GB bf16, ~2.6 GB converted); pass LAYERS=48 for the whole
# geometry where the time allows (62 GB to write first).
set -u
OUT=${OUT:-/tmp/orin-plan-out}
mkdir -p "$OUT"
WORK=${WORK:-$(mktemp -d /tmp/orin-plan-work.XXXX)}
python3 tools/device/orin_plan_checks.py --out "$OUT/orin_plan.json" --work "$WORK" --layers "${LAYERS:-8}" \
    2>&1 | tee "$OUT/orin_plan.log"
