#!/usr/bin/env bash
# nvidia-h200-x2 call of the twelfth session (issue 8): the grouped MXFP4 MoE kernels with join_k (one dot per
# K step; not in the tree: `git apply` the call's patch below first) against the two-dot form.
# GPU 0: `bench/kernels.py $BENCH` (default `--sweep --only moe_join,moe_prefill`: join_k off/on at the decode
# and prefill tiles with the bound and the invariance check, then the prefill tile sweep with join_k on), then
# bench/e2e.py (graphs), then the tests/gpu files in GPU0_TESTS. GPU 1: the MoE kernel tests compiled (TESTS),
# then the tests/gpu files in GPU1_TESTS. Env: BENCH (empty: skip), TESTS, GPU1_TESTS, GPU0_TESTS, E2E_ARGS, *_S.
# Calls: 1 as is (interleaved join_k, docs/results/moe_join_interleaved_session12.patch); 2 `BENCH="--sweep --only
# moe_join" GPU1_TESTS=` (ordered join_k, moe_join_ordered_session12.patch); 3 the split-K fix-up:
# `BENCH="--only linear --quick" TESTS="tests/ops/test_ops_split_fixup_triton.py tests/ops/test_ops_dense_triton.py
# tests/ops/test_ops_fp8_linear_triton.py" GPU0_TESTS="tests/gpu/test_gpu_engine_vs_torch.py tests/gpu/test_gpu_path_vs_torch.py"`.
source bench/device_env.sh
: "${TEST_S:=150}" "${GPU_S:=420}" "${E2E_S:=200}" "${GPU0_S:=200}"
gpu1_tests "${TESTS-tests/ops/test_ops_moe_experts_triton.py tests/ops/test_ops_batch_invariant_tiles.py}" \
  "${GPU1_TESTS-tests/gpu/test_gpu_batch_invariance.py tests/gpu/test_gpu_prefill_invariance.py}"
fw4_checkpoint
if [ -n "${BENCH-x}" ]; then
  timeout ${BENCH_S:-150} python3 bench/kernels.py ${BENCH:---sweep --only moe_join,moe_prefill} --out "$OUT/kernels.json" \
    > "$OUT/kernels.log" 2>&1
  echo "kernels bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/kernels.log" | cut -c1-220
fi
e2e_graphs 12
gpu0_tests
wait
tests_summary
