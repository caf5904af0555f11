#!/usr/bin/env bash
# Third nvidia-h200-x2 call of the ninth session: the MXFP4 up-projection with tl.dot_scaled vs the
# PTX-decode kernel (bench/moe_dot_scaled.py, GPU 0), the FP8 sign fix's tests compiled (GPU 1), and
# tests/gpu split over both GPUs (a cold machine compiles them for > 300 s in one process).
source bench/device_env.sh
G=(tests/gpu/test_*.py); n=${#G[@]}
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -rf tests/ops/test_ops_indexer_q_triton.py \
    tests/ops/test_ops_rope_triton.py tests/ops/test_ops_kv_insert_triton.py > "$OUT/tests1.log" 2>&1
  echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
  timeout ${GPU_S:-330} python3 -m pytest -q -p no:cacheprovider -rf "${G[@]:0:$((n/2))}" >> "$OUT/tests1.log" 2>&1
  echo "tests/gpu (1st half) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log" ) &
export CUDA_VISIBLE_DEVICES=0
timeout ${PROTO_S:-230} python3 bench/moe_dot_scaled.py --out "$OUT/dot_scaled.json" > "$OUT/dot_scaled.log" 2>&1
echo "dot_scaled exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/dot_scaled.log" | cut -c1-170 | tail -75
timeout ${GPU_S:-330} python3 -m pytest -q -p no:cacheprovider -rf "${G[@]:$((n/2))}" > "$OUT/tests0.log" 2>&1
echo "tests/gpu (2nd half) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests0.log"
wait
echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT/tests1.log" "$OUT/tests0.log" | cut -c1-300 | tail -20
