#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 8), after the batch-invariant MoE decode tile became 32 columns /
# 2 warps. GPU 1: tests/gpu (batch invariance 1..64, fast path vs torch path) and the MoE kernel
# tests. GPU 0, alone: a narrow second sweep around the new tile, then bench/e2e.py (graphs).
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-330} python3 -m pytest -q -p no:cacheprovider -rf tests/gpu tests/ops/test_ops_moe_experts_triton.py \
    tests/ops/test_ops_batch_invariant_tiles.py > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
timeout ${SWEEP_S:-70} python3 bench/kernels.py --sweep --only moe_decode_narrow --out "$OUT/moe_decode_sweep2.json" \
  > "$OUT/moe_decode_sweep2.log" 2>&1
echo "sweep exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^sweep|Error" "$OUT/moe_decode_sweep2.log" | cut -c1-260 | head -8
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
timeout ${E2E_S:-180} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --skip-transformers \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -7
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
