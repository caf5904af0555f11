#!/usr/bin/env bash
# nvidia-h200-x2 call of the twelfth session (issue 8): the grouped MXFP4 MoE kernels with join_k (one dot per
# K step over the re-interleaved nibbles; the default in this tree) against the two-dot form.
# GPU 0: `bench/kernels.py $BENCH` (default `--sweep --only moe_join,moe_prefill`: join_k off/on at the decode
# and prefill tiles with the bound and the invariance check, then the prefill tile sweep with join_k on), then
# bench/e2e.py (graphs), then the tests/gpu files in GPU0_TESTS. GPU 1: the MoE kernel tests compiled (TESTS),
# then the tests/gpu files in GPU1_TESTS. Env: BENCH (empty: skip), TESTS, GPU1_TESTS, GPU0_TESTS, E2E_ARGS, *_S.
# Calls: 1 as is (interleaved join_k, docs/results/moe_join_interleaved_session12.patch); 2 `BENCH="--sweep --only
# moe_join" GPU1_TESTS=` (ordered join_k, moe_join_ordered_session12.patch); 3 the split-K fix-up:
# `BENCH="--only linear --quick" TESTS="tests/ops/test_ops_split_fixup_triton.py tests/ops/test_ops_dense_triton.py
# tests/ops/test_ops_fp8_linear_triton.py" GPU0_TESTS="tests/gpu/test_gpu_engine_vs_torch.py tests/gpu/test_gpu_path_vs_torch.py"`.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -rf ${TESTS-tests/ops/test_ops_moe_experts_triton.py \
    tests/ops/test_ops_batch_invariant_tiles.py} > "$OUT/tests1.log" 2>&1
  echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  if [ -n "${GPU1_TESTS-x}" ]; then
    timeout ${GPU_S:-420} python3 -m pytest -q -p no:cacheprovider -rf ${GPU1_TESTS:-tests/gpu/test_gpu_batch_invariance.py \
      tests/gpu/test_gpu_prefill_invariance.py} >> "$OUT/tests1.log" 2>&1
    echo "tests/gpu (GPU 1 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  fi ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
if [ -n "${BENCH-x}" ]; then
  timeout ${BENCH_S:-150} python3 bench/kernels.py ${BENCH:---sweep --only moe_join,moe_prefill} --out "$OUT/kernels.json" \
    > "$OUT/kernels.log" 2>&1
  echo "kernels bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/kernels.log" | cut -c1-220
fi
timeout ${E2E_S:-200} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs \
  ${E2E_ARGS:---batches 1,8,64 --prefill 1024,8192 --skip-transformers} --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -9
e2e_profile "$OUT/e2e.json" 12
if [ -n "${GPU0_TESTS-}" ]; then
  timeout ${GPU0_S:-200} python3 -m pytest -q -p no:cacheprovider -rf $GPU0_TESTS > "$OUT/tests0.log" 2>&1
  echo "tests/gpu (GPU 0 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests0.log"
fi
wait
echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT/tests1.log" "$OUT"/tests0.log 2>/dev/null | cut -c1-300 | tail -20
