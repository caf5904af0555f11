#!/usr/bin/env bash
# nvidia-h200 (one GPU) calls of the eighteenth session (issue 8). Steps, each only when its variable is set:
# ATTN (a JSON list of tile overrides, or "default" for ATTN_VARIANTS below): bench/kernels_attention.py
# --prefill-seq (the 8K prompt's CSA and HCA attention and two decode shapes, bits against the default);
# MHC: bench/kernels_mhc.py with these flags (and --configs "$MHC_CONFIGS" when set); E2E_ARGS: bench/e2e.py
# (E2E_S s at most); then TESTS_A/B/C in parallel pytest processes, stopped DEADLINE_S (default 560) s after the start.
ATTN_VARIANTS='[{"predecode": false}, {"predecode": true}, {"predecode": true, "num_stages": 2},
 {"predecode": true, "num_warps": 8}, {"predecode": true, "BLOCK_H": 32, "num_warps": 4},
 {"predecode": true, "BLOCK_H": 32, "num_warps": 8}, {"predecode": true, "BLOCK_H": 32, "num_warps": 8, "num_stages": 2},
 {"predecode": true, "BLOCK_H": 64, "num_warps": 8}, {"predecode": true, "BLOCK_H": 64, "num_warps": 8, "num_stages": 2}]'
POST_MIX_CONFIGS='[{}, {"POST_MIX_FUSED_MAX_T": 0}, {"POST_MIX_FUSED_MAX_T": 0, "MIX_WARPS_PREFILL": 1},
 {"POST_MIX_FUSED_MAX_T": 0, "MIX_WARPS_PREFILL": 2}]'
[ "${ATTN-}" = default ] && ATTN=$ATTN_VARIANTS
[ "${MHC_CONFIGS-}" = post ] && MHC_CONFIGS=$POST_MIX_CONFIGS
source bench/device_env.sh
: "${DEADLINE_S:=560}"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
if [ -n "${ATTN-}" ]; then
  timeout ${ATTN_S:-200} python3 bench/kernels_attention.py --prefill-seq --variants "$ATTN" --out "$OUT/attn.json" \
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
