#!/usr/bin/env bash
# On the GPU server (device tool), one short call (~3 minutes): the expert GEMVs take the router's slot ids and
# weights as they are (no cast kernels a layer, docs/decode-on-device.md "run 10"). The device token's CUDA tests
# (transformers' tokens), then discrete.py's resident rows on an 8-layer checkpoint of the 30B-A3B geometry, whose
# profiles count the copy kernels a token. Carry `.whl`. Results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. "$(dirname "$0")/carried_wheels.sh"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
python3 setup.py -q build_ext --inplace > "$OUT/native-build.log" 2>&1 || echo "native helper not built"
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_device_decode.py -k cuda 2>&1 \
    | tail -3 | tee "$OUT/device_decode_tests.log"
timeout "${BENCH_S:-120}" python3 tools/bench/discrete.py --out-dir /tmp/bench8 --layers 8 --new-tokens 16 --repeats 1 \
    --strategies device-resident,device-resident-compiled --routings sampled --skip-baselines \
    --json "$OUT/discrete-8layer.json" 2>&1 | grep -v "^ *[\"{}\[]" | grep -v "^profile" | tail -8
python3 - "$OUT/discrete-8layer.json" <<'PY'
import json, sys
for p in json.load(open(sys.argv[1]))["profiles"]:
    copies = sum(n for name, _, n in p["gpu_top"] if "copy" in name)
    print(f"{p['engine']}: {p['gpu_kernels_per_token']:.1f} kernels a token, {copies:.1f} of them copies in the top "
          f"list, busy {p['compute_or_copy_busy']:.3f}, {p['wall_ms_per_token']:.2f} ms a token")
PY
