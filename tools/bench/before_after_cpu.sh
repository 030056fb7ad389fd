#!/usr/bin/env bash
# The README's run and the CPU tiers' decode, two source trees alternating in the same venv: is a change no slower
# on the CPU? (docs/benchmarks.md, "before and after" sections.)
#   bash tools/bench/before_after_cpu.sh BEFORE_TREE AFTER_TREE [ROUNDS] > out.txt
# Each round runs, for before then after: the README's run (`run --prompt ...`, wall and CPU seconds of the
# process, one thread), then `bench --tokens 32 --repeats 3` on the host tier and on the unified tier (median
# decode tok/s of sampled decoding). Run it on an idle machine: the rows are medians of alternating rounds.
# BUDGET (default 100%): the bench rows' --memory-budget; below 100% decode tokens miss and read experts.
set -euo pipefail
BEFORE=${1:?before tree}; AFTER=${2:?after tree}; ROUNDS=${3:-3}; BUDGET=${BUDGET:-100%}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
for round in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        tree=$BEFORE; [ "$side" = after ] && tree=$AFTER
        TIMEFORMAT="%R %U %S"  # wall, user and system seconds of the process (bash's `time`)
        t=$( { time env PYTHONPATH="$tree" "$PY" -m vismmoe_edge.cli run --prompt "What colour is the circle?" \
            > /dev/null 2> /tmp/before_after_run.err; } 2>&1 )
        echo "round $round $side readme wall_user_sys $t"
        for tier in host unified; do
            rate=$(env PYTHONPATH="$tree" "$PY" -m vismmoe_edge.cli bench --tokens 32 --repeats 3 --json \
                --memory-budget "$BUDGET" --pinned-layers 0 --policy lru --tier "$tier" 2>/dev/null \
                | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["median"]["decode_tokens_per_s"])')
            echo "round $round $side bench_$tier decode_tok_s $rate"
        done
    done
done
