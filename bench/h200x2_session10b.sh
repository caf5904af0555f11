#!/usr/bin/env bash
# Second nvidia-h200-x2 call of the tenth session: the changed kernels' tests compiled and tests/gpu
# split over both GPUs (a cold machine compiles them for > 300 s in one process), and two sweeps
# that keep every bit: dense_linear's prefill tile and mhc_post_pre's launch shape
# (bench/kernels_mhc.py --sweep-dense-prefill / --sweep-post-mix).
source bench/device_env.sh
G=(tests/gpu/test_*.py); n=${#G[@]}
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -rf ${TESTS-tests/ops/test_ops_moe_experts_triton.py \
    tests/ops/test_ops_fp8_linear_triton.py tests/ops/test_ops_batch_invariant_tiles.py \
    tests/ops/test_ops_dense_triton.py} > "$OUT/tests1.log" 2>&1
  echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  timeout ${GPU_S:-330} python3 -m pytest -q -p no:cacheprovider -rf "${G[@]:0:$((n/2))}" >> "$OUT/tests1.log" 2>&1
  echo "tests/gpu (1st half) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log" ) &
export CUDA_VISIBLE_DEVICES=0
for sw in dense-prefill post-mix; do
  timeout ${SWEEP_S:-100} python3 bench/kernels_mhc.py --sweep-$sw --out "$OUT/sweep_$sw.json" > "$OUT/sweep_$sw.log" 2>&1
  echo "sweep $sw exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^sweep" "$OUT/sweep_$sw.log" | sed -E "s/'num_warps'/w/g; s/'num_stages'/st/g; s/'BLOCK_/B/g; s/'MIX_/M/g" | cut -c1-170
done
timeout ${GPU_S:-330} python3 -m pytest -q -p no:cacheprovider -rf "${G[@]:$((n/2))}" > "$OUT/tests0.log" 2>&1
echo "tests/gpu (2nd half) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests0.log"
wait
echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT/tests1.log" "$OUT/tests0.log" | cut -c1-300 | tail -20
