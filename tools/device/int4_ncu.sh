#!/usr/bin/env bash
# On the GPU server (device tool): Nsight Compute on the expert GEMVs as a token runs them (int4: gate_up ending
# in the activation, then down; bf16: gate_up, then down with the SiLU input), each launch cold, with the
# sections that say what a kernel waits on (warp states, scheduler, memory, instructions, per-instruction
# samples), and each kernel's SASS. Results under $OUT: gemv.ncu-rep (open it in Nsight Compute's GUI),
# gemv_details.csv, gemv_source_<n>.csv (SASS with its stall samples, where this ncu can export it), int4_ncu/
# (PTX, cubin, SASS, registers, the configs). ~1-2 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. "$(dirname "$0")/carried_wheels.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found on this machine"; exit 1; }
SECTIONS=()
for s in SpeedOfLight Occupancy LaunchStats WarpStateStats SchedulerStats MemoryWorkloadAnalysis \
    ComputeWorkloadAnalysis InstructionStats SourceCounters; do SECTIONS+=(--section "$s"); done
timeout 300 "$NCU" --clock-control none --profile-from-start off --kernel-name regex:gemv --import-source yes \
    "${SECTIONS[@]}" -f -o "$OUT/gemv" python3 tools/device/int4_ncu.py --dump "$OUT/int4_ncu" > "$OUT/ncu.log" 2>&1
echo "ncu: exit $?"; tail -15 "$OUT/ncu.log"
"$NCU" -i "$OUT/gemv.ncu-rep" --page details --csv > "$OUT/gemv_details.csv" 2> "$OUT/ncu_export.log"
for n in 0 1 2 3 4; do  # one kernel each, in int4_ncu/summary.json's launch order
    "$NCU" -i "$OUT/gemv.ncu-rep" --page source --csv --print-source sass --launch-skip "$n" --launch-count 1 \
        > "$OUT/gemv_source_$n.csv" 2>> "$OUT/ncu_export.log" || echo "source page $n not exported"
done
for f in "$OUT"/int4_ncu/*.cubin; do cuobjdump --dump-sass "$f" > "${f%.cubin}.sass" 2>&1; done
grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Warp Cycles Per Issued" \
    "$OUT/gemv_details.csv" | cut -c1-200 | head -80
