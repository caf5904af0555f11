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
: "${TEST_S:=200}" "${GPU_S:=300}" "${E2E_S:=230}" "${GPU0_S:=300}"
gpu1_tests "${TESTS-tests/ops/test_ops_sparse_attention_triton.py tests/ops/test_ops_dense_triton.py}" \
  "${GPU1_TESTS-tests/gpu/test_gpu_prefill_invariance.py tests/gpu/test_gpu_engine_vs_torch.py}"
fw4_checkpoint
if [ -n "${ATTN-1}" ]; then
  timeout ${ATTN_S:-200} python3 bench/kernels_attention.py --prefill-seq ${ATTN_ARGS-} --out "$OUT/attn_prefill_seq.json" \
    > "$OUT/attn_prefill_seq.log" 2>&1
  echo "attention bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/attn_prefill_seq.log" | cut -c1-200
fi
e2e_graphs 16
gpu0_tests
wait
tests_summary
