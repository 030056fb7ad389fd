#!/usr/bin/env bash
# On the GPU server (device tool): the daemon half of prefix_cache_h200.sh (which runs it), alone for a short
# call: builds the 48-layer checkpoint unless a warm machine kept it, then tools/bench/prefix_cache.py against a
# real daemon with every weight resident, recompiles logged (TORCH_LOGS=recompiles): after READY the log must
# show none. Writes prefix_cache.json, prefix_cache.log and daemon.log under $OUT.
#   RUNS=5 bash tools/device/prefix_daemon_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 TORCH_LOGS=recompiles
python3 tools/bench/discrete.py --out-dir /tmp/bench --build-only 2>&1 | tail -1
python3 tools/bench/prefix_cache.py --model /tmp/bench/qwen3vl-30b-a3b-48layer --device cuda \
    --image /tmp/bench/image-1056.png --runs "${RUNS:-5}" --serve-arg=--memory-budget --serve-arg=100% \
    --serve-arg=--host-tier --serve-arg=off --log "$OUT/daemon.log" --json "$OUT/prefix_cache.json" \
    > "$OUT/prefix_cache.log" 2>&1
grep -v '^ ' "$OUT/prefix_cache.log" | tail -8
# the summary (indented in the log, so not above): printed here too, as a call may not bring every file back
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k not in ("rows", "metrics")})' \
    "$OUT/prefix_cache.json"
echo "== recompiles after READY:"
sed -n '/ready: model/,$p' "$OUT/daemon.log" | grep -A4 "Recompiling" | cut -c1-300 || true
