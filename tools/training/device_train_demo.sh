#!/usr/bin/env bash
# On the GPU server (device tool): train the demo model and bring it back as $OUT/demo-model.tar.
#   bash tools/training/device_train_demo.sh [extra train_demo.py args]
set -euo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
python3 tools/training/train_demo.py /tmp/demo-model "$@" 2>&1 | tee "$OUT/train.log"
# The device tool brings back at most 8 files of at most 16 MiB: one compressed archive, in 15 MiB parts.
tar -C /tmp -czf - demo-model | split -b 15M -d - "$OUT/demo-model.tgz.part-"
ls -l "$OUT"
