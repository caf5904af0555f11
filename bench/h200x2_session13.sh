#!/usr/bin/env bash
# nvidia-h200-x2 calls of the thirteenth session (issue 8). GPU 1 (background): the kernel/engine test files in
# TESTS, then the tests/gpu files in GPU1_TESTS. GPU 0: the flash-width checkpoint, `bench/kernels_indexer.py`
# (if INDEXER is non-empty), `bench/kernels.py $BENCH` (if BENCH is set), bench/e2e.py (E2E_ARGS), then the
# tests/gpu files in GPU0_TESTS with whatever time is left before DEADLINE_S (default 570 s after the start).
# Call 1 (indexer selection kernel + async scheduling measured): as is.
# Call 2 (MXFP4 scales as int32 words; async scheduling on by default): TESTS="tests/ops/test_ops_moe_experts_triton.py
# tests/ops/test_ops_batch_invariant_tiles.py" TEST_S=150 GPU1_TESTS="tests/gpu/test_gpu_batch_invariance.py
# tests/gpu/test_gpu_prefill_invariance.py tests/gpu/test_gpu_path_vs_torch.py" GPU_S=400 INDEXER= BENCH="--sweep --only
# moe_scale32" BENCH_S=120 E2E_ARGS="--variants graphs,sync --batches 1,8,64 --prefill 1024,8192 --skip-transformers"
# E2E_S=260 GPU0_TESTS="tests/gpu/test_gpu_engine_vs_torch.py tests/engine/test_engine_async_scheduling.py
# tests/serve/test_serve_async_scheduling.py".
source bench/device_env.sh
: "${TEST_S:=200}" "${GPU_S:=380}" "${E2E_S:=300}" "${DEADLINE_S:=570}"
gpu1_tests "${TESTS-tests/ops/test_ops_indexer_triton.py tests/engine/test_engine_async_scheduling.py tests/serve/test_serve_async_scheduling.py}" \
  "${GPU1_TESTS-tests/gpu/test_gpu_batch_invariance.py tests/gpu/test_gpu_prefill_invariance.py}"
fw4_checkpoint
if [ -n "${INDEXER-x}" ]; then
  timeout ${INDEXER_S:-120} python3 bench/kernels_indexer.py --out "$OUT/indexer.json" > "$OUT/indexer.log" 2>&1
  echo "indexer bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/indexer.log" | cut -c1-200 | tail -40
fi
if [ -n "${BENCH-}" ]; then
  timeout ${BENCH_S:-150} python3 bench/kernels.py $BENCH --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernels bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/kernels.log" | cut -c1-220
fi
E2E_ARGS="${E2E_ARGS---batches 1,8,64 --prefill 1024,8192 --skip-transformers --variants graphs,async}" e2e_graphs 10
GPU0_S=$(( DEADLINE_S - ($(date +%s) - T0) )); echo "GPU-0 tests get ${GPU0_S} s"
[ "$GPU0_S" -gt 30 ] && { : "${GPU0_TESTS=tests/gpu/test_gpu_engine_vs_torch.py}"; gpu0_tests; }
wait
tests_summary
