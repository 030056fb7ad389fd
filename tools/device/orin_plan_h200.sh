#!/bin/bash
# The Orin Nano plan forced through unified-slots on the H200, and quantized dense weights on CUDA (issue 25).
# Results under $OUT. Two forms:
#   bash tools/device/orin_plan_h200.sh                 # one call, <= 8 minutes: an 8-layer proxy, the 48-layer
#                                                       # plan's pinned depth and cache share
#   WORK=.orin-plan LAYERS=48 STAGE=build bash tools/device/orin_plan_h200.sh   # call 1: the 48-layer proxy
#   WORK=.orin-plan LAYERS=48 bash tools/device/orin_plan_h200.sh               # call 2: the same plan, unchanged
# The proxy (tools/checkpoints/streaming_quantized.py) is written straight as int4 experts + int4 dense weights
# in the CUDA layout, with the real vision tower: ~17 GB for 48 layers, ~3.5 GB for 8, no bf16 copy. A WORK inside
# the checkout that git ignores (/.orin-plan/, .gitignore) is kept between calls on a warm machine.
set -u
OUT=${OUT:-/tmp/orin-plan-out}
mkdir -p "$OUT"
WORK=${WORK:-$(mktemp -d /tmp/orin-plan-work.XXXX)}
. "$(dirname "$0")/carried_wheels.sh"  # the transformers we test against, not whatever the machine has
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# On a warm machine the other device scripts' checkpoints may still fill the disk (decode_checks.sh writes 61 GB
# under /tmp/bench): the 48-layer build needs ~17 GB, so those go first.
if [ "${LAYERS:-8}" = 48 ] && [ "${STAGE:-run}" = build ]; then
    rm -rf /tmp/bench /dev/shm/bench-int4
fi
df -h "$WORK" | tail -1
if [ "${STAGE:-run}" = build ]; then
    python3 tools/device/orin_plan_checks.py --build-only --work "$WORK" --layers "${LAYERS:-8}" 2>&1 | tee "$OUT/orin_plan_build.log"
    exit "${PIPESTATUS[0]}"
fi
python3 tools/device/orin_plan_checks.py --out "$OUT/orin_plan.json" --work "$WORK" --layers "${LAYERS:-8}" \
    2>&1 | tee "$OUT/orin_plan.log"
