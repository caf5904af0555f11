#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 8, eighth session, after merging the three fusions:
# kv_norm_rope_insert, compressor_pool_insert, mhc_post_pre; issue 9's canary on the final code).
# GPU 1: the new kernels' tests compiled + tests/gpu (invariance 1..64, engine/path vs torch), then
# the canary (Triton, bf16) in both cache dtypes. GPU 0: bench/e2e.py (graphs), decode_sources at
# batch 1 and 64, then the canary in float32 / 'auto' (its Triton compile takes minutes cold).
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-330} python3 -m pytest -q -p no:cacheprovider -rf tests/ops/test_ops_kv_norm_rope_insert.py \
    tests/ops/test_ops_compressor_triton.py tests/ops/test_ops_mhc_post_pre_triton.py tests/ops/test_ops_mhc_triton.py \
    tests/ops/test_ops_kv_insert_triton.py tests/gpu > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log"
  for kv in auto fp8_ds_mla; do
    timeout ${EVAL_S:-110} python3 -m dsv4.cli eval canary --backend triton --dtype bfloat16 --kv-cache-dtype $kv --check \
      --json-out "$OUT/canary_triton_bfloat16_$kv.json" > "$OUT/canary_bfloat16_$kv.log" 2>&1
    echo "canary bf16 $kv exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log"
  done ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
timeout ${E2E_S:-150} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --skip-transformers \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -7
for b in 1 64; do
  timeout ${SRC_S:-50} python3 bench/decode_sources.py --ckpt /tmp/fw4 --batch $b --top 60 --out "$OUT/sources_b$b.json" \
    > "$OUT/sources_b$b.log" 2>&1
  echo "sources b$b exit $? at $(( $(date +%s) - T0 )) s"; head -3 "$OUT/sources_b$b.log" | cut -c1-200
done
timeout ${F32_S:-330} python3 bench/with_stacks.py --every 60 --to "$OUT/f32_auto_stacks.txt" dsv4.cli eval canary \
  --backend triton --dtype float32 --kv-cache-dtype auto --check --json-out "$OUT/canary_triton_float32_auto.json" \
  > "$OUT/canary_float32_auto.log" 2>&1
echo "canary f32 auto exit $? at $(( $(date +%s) - T0 )) s"
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -20
for f in "$OUT"/canary_triton_*.json; do python3 -c "import json,sys; d=json.load(open('$f')); print('$f'.split('/')[-1], d['accuracy'], d.get('check'))"; done
