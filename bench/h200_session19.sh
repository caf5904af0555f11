#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the nineteenth session (issue 8). Steps, each only when its variable is set:
# ATTN (a JSON list of tile overrides): bench/kernels_attention.py --prefill-seq (the 8K prompt's CSA and HCA
# attention and two decode shapes, bits against the first variant); E2E_ARGS: bench/e2e.py on the 4-layer
# flash-width checkpoint (E2E_S s at most) into e2e.{json,log}; E2E2_ARGS: a second bench/e2e.py run (E2E2_S) into
# e2e2.{json,log}; then TESTS_A/B/C in parallel pytest processes, stopped DEADLINE_S (default 560) s after the start.
# Call 1 (64-head predecoded tile, the 1K A/B, the transformers peer, the 64K prompt, mHC apart at decode):
# ATTN='[{"predecode": true, "BLOCK_H": 32}, {"predecode": true, "BLOCK_H": 64, "num_warps": 8, "PV1": true},
# {"predecode": true, "BLOCK_H": 64, "num_warps": 8, "PV1": true, "BLOCK_N": 16}, {"predecode": true, "BLOCK_H": 64,
# "num_warps": 8, "PV1": true, "num_stages": 2}]' (PV1, one P·V dot over [p2 | p1] against [v; v], existed only in that
# call's tree) E2E_ARGS="--batches 1,64 --prefill 1024,8192 --profile-prefill 1024,8192
# --ab dsv4.ops.triton.sparse_attention.PREDECODE_MIN_T=2048 --long-context 65536" E2E_S=260
# E2E2_ARGS="--batches 1,64 --prefill 1024 --skip-transformers --set dsv4.ops.triton.mhc.CONFIG[POST_MIX_FUSED_MAX_T]=0"
# E2E2_S=170 DEADLINE_S=585.
# Call 2 (the split-K fix-up in the GEMM's launch, docs/results/splitk_fixup_session19.patch, against its absence):
# E2E_ARGS="--batches 1,8,64 --prefill 1024,8192 --skip-transformers" E2E_S=200 E2E2_ARGS="--batches 1,64 --prefill
# 1024 --skip-transformers --set dsv4.ops.triton._common.FIXUP_MAX_TILES=0" E2E2_S=150
# TESTS_A="tests/ops/test_ops_split_k_fixup.py tests/ops/test_ops_fp8_linear_triton.py tests/ops/test_ops_dense_triton.py
# tests/gpu/test_gpu_engine_vs_torch.py" TESTS_B="tests/gpu/test_gpu_batch_invariance.py"
# TESTS_C="tests/gpu/test_gpu_prefill_invariance.py" DEADLINE_S=590.
# Calls 3 and 4 did not use this script (commands in docs/perf.md, "Nineteenth session").
source bench/device_env.sh
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
if [ -n "${ATTN-}" ]; then
  timeout ${ATTN_S:-200} python3 bench/kernels_attention.py --prefill-seq --variants "$ATTN" ${ATTN_BASE:+--base "$ATTN_BASE"} --out "$OUT/attn.json" \
    > "$OUT/attn.log" 2>&1
  echo "attention bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/attn.log" | cut -c1-200
fi
if [ -n "${E2E_ARGS-}" ]; then
  fw4_checkpoint
  e2e_graphs 14
fi
if [ -n "${E2E2_ARGS-}" ]; then
  [ -d /tmp/fw4 ] || fw4_checkpoint
  timeout ${E2E2_S:-200} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs $E2E2_ARGS --out "$OUT/e2e2.json" \
    > "$OUT/e2e2.log" 2>&1
  echo "e2e2 exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e2.log" | cut -c1-240 | tail -7
fi
parallel_tests
