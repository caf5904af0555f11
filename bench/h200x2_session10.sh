#!/usr/bin/env bash
# nvidia-h200-x2 call of the tenth session (issue 8): the MoE and FP8-linear register fixes
# (one live accumulator per output: ptxas showed the prefill tiles spilling), then the prefill tiles.
# GPU 1: the changed kernels' tests compiled, then tests/gpu (invariance 1..64, prefill invariance,
# engine/path vs torch). GPU 0: the prefill-tile sweeps that keep the decode tile's bits
# (bench/kernels.py --sweep --only moe_prefill,linear_prefill), then bench/e2e.py (graphs).
# Env: TESTS (kernel tests), SWEEP (empty: skip), E2E_ARGS, GPU_SPLIT=1 (tests/gpu over both GPUs,
# GPU 0's half after the e2e run). Third call: SWEEP= GPU_SPLIT=1 TESTS="tests/ops/test_ops_dense_triton.py
# tests/ops/test_ops_mhc_post_pre_triton.py" E2E_ARGS="--batches 1,8,64 --prefill 1024,8192 --skip-transformers".
source bench/device_env.sh
G=(tests/gpu/test_*.py); n=${#G[@]}
if [ -n "${GPU_SPLIT-}" ]; then G1=("${G[@]:0:$((n/2))}"); G0=("${G[@]:$((n/2))}"); else G1=("${G[@]}"); G0=(); fi
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -rf ${TESTS-tests/ops/test_ops_moe_experts_triton.py \
    tests/ops/test_ops_fp8_linear_triton.py tests/ops/test_ops_batch_invariant_tiles.py} > "$OUT/tests1.log" 2>&1
  echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  timeout ${GPU_S:-400} python3 -m pytest -q -p no:cacheprovider -rf "${G1[@]}" >> "$OUT/tests1.log" 2>&1
  echo "tests/gpu (GPU 1 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log" ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
if [ -n "${SWEEP-1}" ]; then
  timeout ${SWEEP_S:-240} python3 bench/kernels.py --sweep --only ${SWEEP_ONLY:-moe_prefill,linear_prefill} \
    --out "$OUT/prefill_sweep.json" > "$OUT/prefill_sweep.log" 2>&1
  echo "prefill sweep exit $? at $(( $(date +%s) - T0 )) s"
  grep -E "^sweep" "$OUT/prefill_sweep.log" | sed -E 's/num_warps/w/g; s/num_stages/st/g; s/BLOCK_/B/g' | cut -c1-200
fi
timeout ${E2E_S:-200} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs \
  ${E2E_ARGS:---batches 1,64 --prefill 1024,8192 --skip-transformers} --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -7
e2e_profile "$OUT/e2e.json" 14
if [ ${#G0[@]} -gt 0 ]; then
  timeout ${GPU_S:-400} python3 -m pytest -q -p no:cacheprovider -rf "${G0[@]}" > "$OUT/tests0.log" 2>&1
  echo "tests/gpu (GPU 0 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests0.log"
fi
wait
echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT/tests1.log" "$OUT"/tests0.log 2>/dev/null | cut -c1-300 | tail -20
