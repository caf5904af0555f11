#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the eighteenth session (issue 8). Steps, each only when its variable is set:
# ATTN (a JSON list of tile overrides, or "default" for ATTN_VARIANTS below): bench/kernels_attention.py
# --prefill-seq (the 8K prompt's CSA and HCA attention and two decode shapes, bits against the default);
# MHC: bench/kernels_mhc.py with these flags (and --configs "$MHC_CONFIGS" when set); E2E_ARGS: bench/e2e.py
# (E2E_S s at most); then TESTS_A/B/C in parallel pytest processes, stopped DEADLINE_S (default 560) s after the start.
# Call 1 (keys decoded once, first form: the bf16 keys' MMA operands took kWidth 2, other bits; the mHC post and pre
# apart): ATTN=<the first variant list: predecode off/on, 16/32/64 heads, 4/8 warps, 1/2 stages> MHC="--sweep-post-mix"
# MHC_CONFIGS=post E2E_ARGS="--batches 1 --prefill 1024,8192 --skip-transformers" E2E_S=150
# TESTS_A="tests/ops/test_ops_sparse_attention_triton.py tests/ops/test_ops_mhc_post_pre_triton.py"
# TESTS_B="tests/gpu/test_gpu_prefill_invariance.py" TESTS_C="tests/gpu/test_gpu_engine_vs_torch.py" DEADLINE_S=585.
# Call 2 (the bf16 keys' dots given the FP8 grouping by a byte-loaded mask; mHC apart above 64 tokens, 1 prefill warp):
# ATTN=<predecode off/on, 16/32 heads, 4/8 warps, 1/2 stages> E2E_ARGS="--batches 1 --prefill 1024,8192
# --skip-transformers" E2E_S=150 TESTS_A="tests/ops/test_ops_sparse_attention_triton.py
# tests/ops/test_ops_mhc_post_pre_triton.py tests/ops/test_ops_mhc_triton.py"
# TESTS_B="tests/gpu/test_gpu_prefill_invariance.py" TESTS_C="tests/gpu/test_gpu_engine_vs_torch.py
# tests/gpu/test_gpu_path_vs_torch.py" DEADLINE_S=585.
# Call 3 (FP8 records read as int32 words: that tree's kernel is docs/results/attn_words_session18.patch, and its
# script had a WORDS_TESTS step, since removed, running the attention tests with WORDS = True):
# ATTN=<words on: predecode off/on, 32 heads; words off> ATTN_BASE='{"words": true}'
# WORDS_TESTS="tests/ops/test_ops_sparse_attention_triton.py" DEADLINE_S=300.
# Call 4 (the final tree: kWidth 2 for bf16 q, FP8 loads one block ahead; kWidth 4 for fp32 q): ATTN=default
# ATTN_OTHER=<the committed kernel module, git show d2df603:dsv4/ops/triton/sparse_attention.py, carried untracked>
# E2E_ARGS="--batches 1,8,64 --prefill 1024,8192 --skip-transformers" E2E_S=220
# TESTS_A="tests/ops/test_ops_sparse_attention_triton.py tests/ops/test_ops_mhc_post_pre_triton.py"
# TESTS_B="tests/gpu/test_gpu_prefill_invariance.py tests/gpu/test_gpu_engine_vs_torch.py"
# TESTS_C="tests/gpu/test_gpu_batch_invariance.py" DEADLINE_S=560.
ATTN_VARIANTS='[{"predecode": false}, {"predecode": true}, {"predecode": true, "BLOCK_H": 32},
 {"predecode": true, "BLOCK_H": 32, "num_warps": 8}, {"predecode": true, "BLOCK_H": 32, "num_stages": 2}]'
POST_MIX_CONFIGS='[{}, {"POST_MIX_FUSED_MAX_T": 0}, {"POST_MIX_FUSED_MAX_T": 0, "MIX_WARPS_PREFILL": 1},
 {"POST_MIX_FUSED_MAX_T": 0, "MIX_WARPS_PREFILL": 2}]'
[ "${ATTN-}" = default ] && ATTN=$ATTN_VARIANTS
[ "${MHC_CONFIGS-}" = post ] && MHC_CONFIGS=$POST_MIX_CONFIGS
source bench/device_env.sh
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
if [ -n "${ATTN-}" ]; then
  timeout ${ATTN_S:-200} python3 bench/kernels_attention.py --prefill-seq --variants "$ATTN" ${ATTN_BASE:+--base "$ATTN_BASE"} ${ATTN_OTHER:+--other "$ATTN_OTHER"} --out "$OUT/attn.json" \
    > "$OUT/attn.log" 2>&1
  echo "attention bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/attn.log" | cut -c1-200
fi
if [ -n "${MHC-}" ]; then
  timeout ${MHC_S:-150} python3 bench/kernels_mhc.py $MHC ${MHC_CONFIGS:+--configs "$MHC_CONFIGS"} --out "$OUT/mhc.json" > "$OUT/mhc.log" 2>&1
  echo "mhc bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/mhc.log" | cut -c1-300
fi
if [ -n "${E2E_ARGS-}" ]; then
  fw4_checkpoint
  e2e_graphs 14
fi
parallel_tests
