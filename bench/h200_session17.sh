#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the seventeenth session (issue 8). Steps, each only when its variable is set:
# W16 (its arguments): bench/fp8_w16.py; ROPE=1: bench/kernels_rope.py (the RoPE kernels); MHC: bench/kernels_mhc.py with these flags (and --configs
# "$MHC_CONFIGS" when set);
# TRACE (prompt lengths, space-separated): bench/prefill_trace.py on the flash-width checkpoint (the GPU's idle
# gaps in a prefill and what the host did in them); E2E_ARGS: bench/e2e.py (E2E_S s at most); then TESTS_A/B/C in
# parallel pytest processes, stopped DEADLINE_S (default 560) s after the start.
# Call 1: ROPE=1 TRACE="8192 1024" TESTS_A="tests/ops/test_ops_rope_triton.py" DEADLINE_S=400.
# Call 2 (the tensor-core mHC mixes): ROPE=1 MHC="--sweep-mix --sweep-post-mix" E2E_ARGS=... (stopped at the mixes
# sweep's time limit after two configs, before the e2e; the script's TRACE loop then failed on an unset variable).
# Call 3: MHC="--sweep-post-mix" MHC_CONFIGS=post (POST_MIX_CONFIGS below; the default then had 4 prefill warps) E2E_ARGS="--batches 1,64 --prefill 1024,8192
# --skip-transformers" E2E_S=230 TESTS_A="tests/ops/test_ops_mhc_triton.py tests/ops/test_ops_mhc_post_pre_triton.py
# tests/ops/test_ops_rope_triton.py" TESTS_B="tests/gpu/test_gpu_batch_invariance.py"
# TESTS_C="tests/gpu/test_gpu_prefill_invariance.py tests/gpu/test_gpu_engine_vs_torch.py" DEADLINE_S=590.
# Call 4 (the final tree: 1 prefill warp for the fused post + mixes; with the peer and the ceilings):
# E2E_ARGS="--batches 1,8,64 --prefill 1024,8192" E2E_S=300 TESTS_A="tests/ops/test_ops_mhc_post_pre_triton.py
# tests/gpu/test_gpu_prefill_invariance.py" TESTS_B="tests/gpu/test_gpu_batch_invariance.py"
# TESTS_C="tests/gpu/test_gpu_engine_vs_torch.py tests/gpu/test_gpu_path_vs_torch.py" DEADLINE_S=590.
# Call 5 (the experiment: the weight dequantized by torch ops, five shapes): W16="--m 8192" W16_S=270 DEADLINE_S=300.
# Call 6 (w16 in the engine): W16="--m 8192" W16_S=110 E2E_ARGS="--batches 1 --prefill 1024,8192 --skip-transformers"
# E2E_S=120 TESTS_A="tests/ops/test_ops_fp8_linear_triton.py tests/gpu/test_gpu_prefill_invariance.py"
# TESTS_B="tests/gpu/test_gpu_engine_vs_torch.py" DEADLINE_S=330.
POST_MIX_CONFIGS='[{}, {"POST_MIX_WARPS_PREFILL": 1}, {"POST_MIX_WARPS_PREFILL": 2}, {"POST_MIX_WARPS_PREFILL": 8},
 {"MIX_WARPS": 1}, {"MIX_WARPS": 2}, {"MIX_BLOCK_T": 16}, {"MIX_BF16X3": false, "POST_MIX_WARPS_PREFILL": 1}]'
[ "${MHC_CONFIGS-}" = post ] && MHC_CONFIGS=$POST_MIX_CONFIGS
source bench/device_env.sh
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
if [ -n "${W16-}" ]; then
  timeout ${W16_S:-200} python3 bench/fp8_w16.py $W16 --out "$OUT/w16.json" > "$OUT/w16.log" 2>&1
  echo "w16 experiment exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/w16.log" | cut -c1-230
fi
if [ -n "${ROPE-}" ]; then
  timeout ${ROPE_S:-120} python3 bench/kernels_rope.py --out "$OUT/rope.json" > "$OUT/rope.log" 2>&1
  echo "rope bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/rope.log" | cut -c1-200
fi
if [ -n "${MHC-}" ]; then
  timeout ${MHC_S:-150} python3 bench/kernels_mhc.py $MHC ${MHC_CONFIGS:+--configs "$MHC_CONFIGS"} --out "$OUT/mhc.json" > "$OUT/mhc.log" 2>&1
  echo "mhc bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/mhc.log" | cut -c1-300
fi
if [ -n "${TRACE-}${E2E_ARGS-}" ]; then
  fw4_checkpoint
fi
for L in ${TRACE-}; do
  timeout ${TRACE_S:-150} python3 bench/prefill_trace.py --ckpt /tmp/fw4 --len "$L" --out "$OUT/trace_$L.json" \
    --trace "$OUT/trace_$L.chrome.json" > "$OUT/trace_$L.log" 2>&1
  echo "trace $L exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/trace_$L.log" | cut -c1-260 | head -70
  gzip -f "$OUT/trace_$L.chrome.json" 2>/dev/null
done
[ -n "${E2E_ARGS-}" ] && e2e_graphs 10
parallel_tests
