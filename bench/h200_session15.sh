#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the fifteenth session (issue 8). Steps, each only when its variable is set:
# `bench/kernels.py $BENCH` (timings); `bench/kernels_attention.py $ATTN` (ATTN_S s at most); Nsight Compute on the
# sparse attention (NCU_ATTN: cases of bench/attn_ncu.py) and on the grouped MoE kernels (NCU_T); the flash-width
# checkpoint and bench/e2e.py (E2E_ARGS); then TESTS_A/B/C in parallel pytest processes (correctness only),
# stopped DEADLINE_S (default 560) s after the start.
# Call 1 (kperm end to end, with the peer; the attention's stall reasons): NCU_ATTN=csa-prefill,hca-prefill,csa-decode64
# E2E_ARGS="--batches 1,8,64 --prefill 1024,8192" E2E_S=470.
source bench/device_env.sh
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
[ -n "${BENCH-}" ] && kernels_bench
if [ -n "${ATTN-}" ]; then
  timeout ${ATTN_S:-200} python3 bench/kernels_attention.py $ATTN ${ATTN_VARIANTS:+--variants "$ATTN_VARIANTS"} \
    --out "$OUT/attn.json" > "$OUT/attn.log" 2>&1
  echo "attention bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/attn.log" | cut -c1-200 | tail -40
fi
[ -n "${NCU_ATTN-}" ] && ncu_attn "$NCU_ATTN"
[ -n "${NCU_T-}" ] && ncu_moe "$NCU_T" "${NCU_CONFIG-}"
if [ -n "${E2E_ARGS-}" ]; then
  fw4_checkpoint
  e2e_graphs 10
fi
parallel_tests
