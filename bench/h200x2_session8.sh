#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 8, eighth session; issue 9's float32 'auto' canary run).
# GPU 1: the canary eval that timed out (Triton, float32, 'auto' cache) with Python stacks every
# 40 s, then tests/gpu and the FP8 linear kernel tests (grouped wo_a). GPU 0: bench/e2e.py
# (graphs: staged graph inputs, shared rope tables, grouped wo_a), then bench/decode_sources.py.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${DIAG_S:-200} python3 bench/with_stacks.py --every 40 --to "$OUT/f32_auto_stacks.txt" dsv4.cli eval canary \
    --backend triton --dtype float32 --kv-cache-dtype auto --check --json-out "$OUT/canary_triton_float32_auto.json" \
    > "$OUT/canary_f32_auto.log" 2>&1
  echo "f32 auto exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/canary_f32_auto.log"
  timeout ${TEST_S:-320} python3 -m pytest -q -p no:cacheprovider -rf tests/gpu tests/ops/test_ops_fp8_linear_triton.py \
    > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
timeout ${E2E_S:-190} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --skip-transformers \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -7
for b in 1 64; do
  timeout ${SRC_S:-70} python3 bench/decode_sources.py --ckpt /tmp/fw4 --batch $b --top 60 --out "$OUT/sources_b$b.json" \
    > "$OUT/sources_b$b.log" 2>&1
  echo "sources b$b exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/sources_b$b.log" | head -14 | cut -c1-200
done
wait
echo "== canary f32 auto"; tail -c 400 "$OUT/canary_f32_auto.log"
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
