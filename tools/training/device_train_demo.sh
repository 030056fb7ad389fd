#!/usr/bin/env bash
# On the GPU machine (device tool, one H200): train the demo model within one command and bring it back in $OUT.
#
#   bash tools/training/device_train_demo.sh [--budget SECONDS] [--init DIR|PARTS_PREFIX] [train_demo.py args...]
#
# --budget  wall seconds the whole command may take (default 540: ends well inside the 10-minute limit); the
#           training gets what is left after start-up, the closing evaluation (--eval-seconds, 90) and packing.
# --init    checkpoint to continue from: a directory in the tree, or the prefix of the parts a previous call
#           returned ("demo-model.tgz.part-"), copied into an ignored folder and carried (e.g. .ckpt/); default:
#           the shipped vismmoe_edge/demo_model.
# Needs the transformers >= 5.20 wheel carried in .whl/ (the machine has 5.17). The first 20 s of training are
# plain steps (the probe's plain path), then every step is a CUDA graph (its rate over the next 20 s is the graph
# path's); both rates, the profile windows and the data-loader wait are printed and written to profile.json.
# (--smoke runs the same on this CPU.) $OUT gets (at most 8 files): train.log, training.json, profile.json, demo-model.tgz.part-00.. (15 MiB each).
set -euo pipefail
T0=$(date +%s)
BUDGET=540
INIT=vismmoe_edge/demo_model
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET=$2; shift 2 ;;
        --init) INIT=$2; shift 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
if [ -e "${INIT}00" ]; then  # parts of a returned archive: reassemble
    mkdir -p /tmp/init && cat "${INIT}"* | tar -C /tmp/init -xzf - && INIT=/tmp/init/demo-model
fi
python3 - <<'EOF'
import os, shutil, torch, transformers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "transformers", transformers.__version__, gpu,
      f"{os.cpu_count()} CPUs, /dev/shm free {shutil.disk_usage('/dev/shm').free / 2**30:.0f} GiB")
assert tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 20), "carry the transformers wheel"
EOF
# training must end so that the check (--eval-seconds), saving and packing (~30 s) still fit the budget
DEADLINE=$((T0 + BUDGET - 90 - 35))
echo "start-up took $(( $(date +%s) - T0 )) s; training until $((DEADLINE - $(date +%s))) s from now"
set +e
python3 tools/training/train_demo.py /tmp/demo-model --init "$INIT" --deadline "$DEADLINE" --minutes 30 \
    --eval-seconds 90 --profile-json "$OUT/profile.json" ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/train.log"
STATUS=${PIPESTATUS[0]}
set -e
# The device tool brings back at most 8 files of at most 16 MiB: one compressed archive in 15 MiB parts.
if [ -f /tmp/demo-model/model.safetensors.index.json ]; then
    cp /tmp/demo-model/training.json "$OUT/training.json"
    tar -C /tmp -czf - demo-model | split -b 15M -d - "$OUT/demo-model.tgz.part-"
fi
ls -l "$OUT"
echo "train_demo.py exit status $STATUS; whole command $(( $(date +%s) - T0 )) s"
exit "$STATUS"
