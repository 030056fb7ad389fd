#!/usr/bin/env bash
# On the GPU server (device tool), the first call of a session's runs (at most ~9.5 minutes):
#   - the 48-layer checkpoint of tools/bench/discrete.py, built once for this call and the `bench` call after it;
#   - the read-in-place equivalence check with compiled layers (decode_checks.py --compile --only-mapped): the
#     device token's mapped layer under the near-tie rule, before a `bench` call times its rows;
#   - on an H200, issue 26's daemon check (prefix_daemon_check.sh, RUNS=5: its target is the H200's); on another
#     card, decode_checks.sh unified with the time left (unified-slots against its bus bound, computing experts as
#     their reads land against waiting for every read).
# Carry `.whl` and `.carry`; tar $OUT after it. Then, on the warm machine:
#   BENCH_STRATS=device-mapped,device-mapped-lookahead-2,budget-default LIMIT=540 bash tools/device/decode_checks.sh bench
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
echo "== read-in-place equivalence, compiled layers"
timeout 150 python3 tools/device/decode_checks.py --compile --only-mapped --skip-layer --out "$OUT/mapped_checks.json" \
    2>&1 | grep "^\[" | tail -8
left=$((TOTAL - ($(date +%s) - T0)))
if [[ "$GPU" == *H200* ]]; then
    echo "== issue 26: the daemon's second question ($left s left)"
    RUNS=5 timeout "$left" bash "$(dirname "$0")/prefix_daemon_check.sh"
else
    echo "== unified-slots against its bus bound ($left s left)"
    LIMIT=$left bash "$(dirname "$0")/decode_checks.sh" unified
fi
echo "mapped_first.sh took $(( $(date +%s) - T0 )) s"
