#!/usr/bin/env bash
# nvidia-h200-x2 call of the eleventh session (issue 8): the sparse attention over decoded page copies
# for prefill-sized steps, and the router GEMM with bf16 operands (tenth session, never run on a GPU).
# GPU 0: bench/kernels_attention.py --prefill-seq (one 8K prompt: in-kernel FP8 decode vs decoded copies,
# the copies' tile sweep, each checked bitwise), then bench/e2e.py (graphs). GPU 1: the changed kernels'
# tests compiled, then the tests/gpu files in GPU1_TESTS. Env: TESTS, GPU1_TESTS, GPU0_TESTS (after e2e),
# ATTN (empty: skip the attention bench), E2E_ARGS, DIAG (a command run first on GPU 1), *_S timeouts.
# Third call: ATTN= DIAG="python3 bench/attn_accuracy.py --other .whl/old_sa.py" E2E_S=480 GPU1_TESTS="tests/gpu/test_gpu_prefill_invariance.py
# tests/gpu/test_gpu_engine_vs_torch.py tests/gpu/test_gpu_path_vs_torch.py" E2E_ARGS="--batches 1,8,64 --prefill 1024,8192".
# Fourth call: ATTN_ARGS="--other .whl/old_sa.py" (the HEAD kernel module, carried) with the same DIAG, the e2e at
# batches 1,64 and 8K only.
# The kernels those calls measured are not in the tree: to rerun, `git apply` the experiment's patch first
# (docs/results/attn_decoded_copies_session11.patch: call 1; attn_split_load_session11.patch: call 4, and call 3
# with SPLIT_LOAD=2 as pick_config's default) and `git show ace2714:dsv4/ops/triton/sparse_attention.py >
# .whl/old_sa.py` for --other (.whl is carried).
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  if [ -n "${DIAG-}" ]; then timeout ${DIAG_S:-120} bash -c "$DIAG" > "$OUT/diag.log" 2>&1; echo "diag exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/diag.log"; fi
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -rf ${TESTS-tests/ops/test_ops_sparse_attention_triton.py \
    tests/ops/test_ops_dense_triton.py} > "$OUT/tests1.log" 2>&1
  echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  if [ -n "${GPU1_TESTS-x}" ]; then
    timeout ${GPU_S:-300} python3 -m pytest -q -p no:cacheprovider -rf ${GPU1_TESTS:-tests/gpu/test_gpu_prefill_invariance.py \
      tests/gpu/test_gpu_engine_vs_torch.py} >> "$OUT/tests1.log" 2>&1
    echo "tests/gpu (GPU 1 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  fi ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
if [ -n "${ATTN-1}" ]; then
  timeout ${ATTN_S:-200} python3 bench/kernels_attention.py --prefill-seq ${ATTN_ARGS-} --out "$OUT/attn_prefill_seq.json" \
    > "$OUT/attn_prefill_seq.log" 2>&1
  echo "attention bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/attn_prefill_seq.log" | cut -c1-200
fi
timeout ${E2E_S:-230} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs \
  ${E2E_ARGS:---batches 1,8,64 --prefill 1024,8192 --skip-transformers} --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -9
e2e_profile "$OUT/e2e.json" 16
if [ -n "${GPU0_TESTS-}" ]; then
  timeout ${GPU0_S:-300} python3 -m pytest -q -p no:cacheprovider -rf $GPU0_TESTS > "$OUT/tests0.log" 2>&1
  echo "tests/gpu (GPU 0 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests0.log"
fi
wait
[ -f "$OUT/diag.log" ] && { echo "== diag"; grep -vE "Warning|warn" "$OUT/diag.log" | cut -c1-220; }
echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT/tests1.log" "$OUT"/tests0.log 2>/dev/null | cut -c1-300 | tail -20
