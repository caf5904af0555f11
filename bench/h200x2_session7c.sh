#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 8). GPU 1: tests/gpu on the merged host-overhead branch (one
# staged host→device copy per step, pinned on CUDA: not run on a GPU before). GPU 0, alone: the
# batch-invariant MoE decode tile sweep, then bench/e2e.py (graphs) on this tree.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-400} python3 -m pytest -q -p no:cacheprovider -rf tests/gpu > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
timeout ${SWEEP_S:-200} python3 bench/kernels.py --sweep --only moe_decode --out "$OUT/moe_decode_sweep.json" \
  > "$OUT/moe_decode_sweep.log" 2>&1
echo "sweep exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^sweep|Error" "$OUT/moe_decode_sweep.log" | cut -c1-260 | head -14
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
timeout ${E2E_S:-200} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --skip-transformers \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -8
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
