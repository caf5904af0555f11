#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the thirteenth session (issue 8), when the two-GPU machine was not lent.
# Optional first step alone on the GPU (for its timings): `bench/kernels.py $BENCH` (BENCH set), then the
# flash-width checkpoint and bench/e2e.py (if E2E_ARGS is set); then test groups in parallel on the same GPU
# (correctness only): each of TESTS_A, TESTS_B, TESTS_C (space-separated files; empty: skipped) in its own
# pytest process, all stopped DEADLINE_S (default 560) s after the start.
# Call 2 (MXFP4 scales as int32 words): BENCH="--sweep --only moe_scale32" TESTS_A="tests/ops/test_ops_moe_experts_triton.py
# tests/ops/test_ops_batch_invariant_tiles.py" TESTS_B="tests/gpu/test_gpu_batch_invariance.py
# tests/gpu/test_gpu_prefill_invariance.py" TESTS_C="tests/gpu/test_gpu_path_vs_torch.py".
# Call 3 (e2e of the kept tree, async tests): E2E_ARGS="--variants graphs,sync --batches 1,8,64 --prefill 1024,8192
# --skip-transformers" E2E_S=240 TESTS_A="tests/gpu/test_gpu_engine_vs_torch.py tests/serve/test_serve_async_scheduling.py"
# TESTS_B="tests/engine/test_engine_async_scheduling.py" DEADLINE_S=555. Call 4 (the two tests fixed after call 3 and the
# graph-safety check): TESTS_A="tests/engine/test_engine_async_scheduling.py" TESTS_B="three engine tests" DEADLINE_S=300.
# Call 5 (the MoE kernels' K step): BENCH="--sweep --only moe_block_k" BENCH_S=230.
# Call 6 (the OpenAI server over the async engine; carry .whl_serve too, the server's wheels for Python 3.12:
# `pip download --platform manylinux2014_x86_64 --python-version 3.12 --only-binary=:all: -d .whl_serve fastapi uvicorn
# "pydantic>=2" prometheus-client`): SERVE_WHEELS=1 TESTS_A="tests/serve/test_serve_async_scheduling.py" DEADLINE_S=200.
source bench/device_env.sh
[ -n "${SERVE_WHEELS-}" ] && serve_wheels
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
[ -n "${BENCH-}" ] && kernels_bench
if [ -n "${E2E_ARGS-}" ]; then
  fw4_checkpoint
  e2e_graphs 10
fi
parallel_tests
