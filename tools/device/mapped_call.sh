#!/usr/bin/env bash
# On the GPU server (device tool), one call of at most ~9.5 minutes for reading experts in place (issue 24):
#   - the 48-layer checkpoint of tools/bench/discrete.py, built once;
#   - the read-in-place equivalence checks with compiled layers, with and without the lookahead
#     (decode_checks.py --compile --only-mapped): the device token's mapped layer under the near-tie rule, before any
#     row of it is timed;
#   - decode_checks.sh bench with the time left: the rows reading in place with the slots' first experts ranked by
#     the prompt's last tokens first (the default since run 20) and by its plain counts (BENCH_STRATS), sampled and
#     replayed routing (ROUTINGS), then transformers' static cache in the same call. Since run 21 the engine at the
#     budget keeps its token embedding in pinned host memory and has its 0.58 GiB as slots (EMBEDDING=device: as
#     before). (Run 20 compared the lookahead here: BENCH_STRATS=device-mapped,device-mapped-lookahead-2
#     ROUTINGS=sampled.)
# Carry `.whl` and `.carry`; tar $OUT after it.
#   bash tools/device/mapped_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
TOTAL=${TOTAL:-560}  # seconds for the whole script
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "== $GPU"
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
python3 setup.py -q build_ext --inplace > "$OUT/native-build.log" 2>&1 || echo "native helper not built"
timeout 200 python3 tools/bench/discrete.py --out-dir /tmp/bench --build-only 2>&1 | tail -1
echo "== read-in-place equivalence, compiled layers, without and with the lookahead"
timeout "${CHECK_S:-180}" python3 tools/device/decode_checks.py --compile --only-mapped --skip-layer \
    --out "$OUT/mapped_checks.json" 2>&1 | grep "^\[" | tail -8
left=$((TOTAL - ($(date +%s) - T0)))
echo "== bench with $left s left"
BENCH_STRATS=${BENCH_STRATS:-device-mapped,device-mapped-flat-prompt} ROUTINGS=${ROUTINGS:-sampled,trace-replay} \
    LIMIT=$left \
    bash "$(dirname "$0")/decode_checks.sh" bench
echo "mapped_call.sh took $(( $(date +%s) - T0 )) s"
