#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the twentieth session (issue 8). Steps, each only when its variable is set:
# SWEEP: bench/kernels.py --sweep --only "$SWEEP" (SWEEP_S s at most) into sweep.{json,log}; E2E_ARGS: bench/e2e.py
# on the 4-layer flash-width checkpoint (E2E_S s at most) into e2e.{json,log}; KERNELS_ARGS: bench/kernels.py (the
# kernel table, until DEADLINE_S) into kernels.{json,log}; then TESTS_A/B/C/D in parallel
# pytest processes, stopped DEADLINE_S (default 560) s after the start (TESTS_FIRST=1: the tests alone, first).
# The calls' environments are listed in docs/perf.md, "Twentieth session".
source bench/device_env.sh
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
if [ -n "${SWEEP-}" ]; then
  timeout ${SWEEP_S:-200} python3 bench/kernels.py --sweep --only "$SWEEP" --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/sweep.log" | cut -c1-200 | tail -40
fi
if [ -n "${E2E_ARGS-}" ]; then
  fw4_checkpoint
  e2e_graphs 14
fi
if [ -n "${KERNELS_ARGS-}" ]; then
  timeout $(( DEADLINE_S - ($(date +%s) - T0) )) python3 bench/kernels.py $KERNELS_ARGS --out "$OUT/kernels.json" \
    > "$OUT/kernels.log" 2>&1
  echo "kernels exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/kernels.log" | cut -c1-200 | tail -60
fi
parallel_tests
