#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the fourteenth session (issue 8). Steps, each only when its variable is set:
# `bench/kernels.py $BENCH` alone on the GPU (timings); Nsight Compute on the grouped MoE kernels at the Ts in
# NCU_T (NCU_CONFIG: JSON overrides; bench/moe_ncu.py); the flash-width checkpoint and bench/e2e.py (E2E_ARGS);
# then TESTS_A/B/C in parallel pytest processes (correctness only), stopped DEADLINE_S (default 560) s after the
# start. SERVE_WHEELS=1 installs the server's wheels (carry .whl_serve; see bench/h200_session13.sh).
# Call 1 (register caps, scale look-ahead, stall reasons, the server's async test over a GPU engine):
# BENCH="--sweep --only moe_maxnreg,moe_scale_ahead" BENCH_S=300 NCU_T=1,64,8192 SERVE_WHEELS=1
# TESTS_A="tests/serve/test_serve_async_scheduling.py tests/ops/test_ops_moe_experts_triton.py".
# Call 2 (scale look-ahead on by default; the scales' layout): BENCH="--sweep --only moe_scale_layout" BENCH_S=200
# NCU_T=64 NCU_SCALES="checkpoint rows-contiguous" NCU_LINES=80. Call 3 (GPU tests of the kept tree): TESTS_A=batch invariance
# TESTS_B=prefill invariance TESTS_C="engine vs torch, path vs torch, stacking and MoE kernel tests" DEADLINE_S=540. Call 4: BENCH="--only
# moe" E2E_ARGS="--batches 1,8,64 --prefill 1024,8192 --skip-transformers" E2E_S=300. Call 5: BENCH="--only moe" NCU_T=1,8192 (this
# ran the checkpoint layout: the NCU_SCALES default was changed after it), then --sweep --only moe_scale_layout.
# Call 6 (gate and up in separate programs; not kept: apply docs/results/moe_split_gu_session14.patch to rerun):
# BENCH="--sweep --only moe_split_gu" BENCH_S=200
# TESTS_A="tests/ops/test_ops_moe_experts_triton.py". Call 7 (the peer in the same run): E2E_ARGS="--batches 1,8,64
# --prefill 1024,8192" E2E_S=470. Call 8 (the MMA operands in the register operand's K order, on by default): BENCH="--sweep
# --only moe_kperm" BENCH_S=90 TESTS_A=batch invariance TESTS_B=prefill invariance TESTS_C="engine vs torch, MoE kernel and
# invariant-tile tests" DEADLINE_S=300.
source bench/device_env.sh
[ -n "${SERVE_WHEELS-}" ] && serve_wheels
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
[ -n "${BENCH-}" ] && kernels_bench
if [ -n "${NCU_T-}" ]; then  # one Nsight Compute run per scale layout in NCU_SCALES (default: the engine's)
  for sc in ${NCU_SCALES:-rows-contiguous}; do NCU_ARGS="--scales $sc" NCU_TAG="_$sc" ncu_moe "$NCU_T" "${NCU_CONFIG-}"; done
fi
if [ -n "${E2E_ARGS-}" ]; then
  fw4_checkpoint
  e2e_graphs 10
fi
parallel_tests
