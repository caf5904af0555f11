#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the fifteenth session (issue 8). Steps, each only when its variable is set:
# `bench/kernels.py $BENCH` (timings); `bench/kernels_attention.py $ATTN` (ATTN_S s at most); Nsight Compute on the
# sparse attention (NCU_ATTN: cases of bench/attn_ncu.py) and on the grouped MoE kernels (NCU_T); the flash-width
# checkpoint and bench/e2e.py (E2E_ARGS); then TESTS_A/B/C in parallel pytest processes (correctness only),
# stopped DEADLINE_S (default 560) s after the start.
# Call 1 (kperm end to end, with the peer; the attention's stall reasons): NCU_ATTN=csa-prefill,hca-prefill,csa-decode64
# E2E_ARGS="--batches 1,8,64 --prefill 1024,8192" E2E_S=470 (ran with NCU_S=170 E2E_S=400).
# Call 2 (attention variants; needs docs/results/attn_{chunked,dc}_session15.patch applied and the committed kernel
# as sa_head_tmp.py: `git show HEAD:dsv4/ops/triton/sparse_attention.py > sa_head_tmp.py`):
# ATTN="--prefill-seq --other sa_head_tmp.py" ATTN_VARIANTS='[{"DC":true},{"DC":true,"BLOCK_H":64},...]' ATTN_S=330
# TESTS_A="tests/ops/test_ops_sparse_attention_triton.py" TESTS_B="tests/gpu/test_gpu_batch_invariance.py" DEADLINE_S=570.
# Call 3 (chunked patch; maxnreg and 32-head tiles): ATTN as call 2, ATTN_VARIANTS='[{"maxnreg":168},{"maxnreg":128},
# {"BLOCK_H":32,"num_warps":8},{"BLOCK_H":32,"num_warps":8,"BLOCK_N":64},{"BLOCK_H":32,"num_warps":8,"maxnreg":128},
# {"num_stages":2}]' ATTN_S=300 TESTS_A="tests/ops/test_ops_sparse_attention_triton.py" DEADLINE_S=420.
# Call 4 (the greedy pick; run inline, its steps are these functions): serve_wheels; bench/kernels.py --only pick;
# fw4_checkpoint; E2E_ARGS="--batches 1,8,64 --prefill 1024 --skip-transformers" E2E_S=250 e2e_graphs 6; TESTS_A="tests/ops/
# test_ops_greedy_pick_triton.py tests/engine/test_engine_sampling.py" TESTS_B="tests/gpu/test_gpu_engine_vs_torch.py"
# TESTS_C="tests/engine/test_engine_async_scheduling.py tests/serve/test_serve_async_scheduling.py" parallel_tests
# (carry .whl and .whl_serve). Call 5 (the final tree's GPU tests): DEADLINE_S=390 TESTS_A="tests/gpu/
# test_gpu_batch_invariance.py" TESTS_B="tests/gpu/test_gpu_prefill_invariance.py tests/gpu/test_gpu_path_vs_torch.py"
# parallel_tests (after sourcing bench/device_env.sh).
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
