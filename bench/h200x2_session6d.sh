#!/usr/bin/env bash
# One short nvidia-h200-x2 call (issue 8): after hc_pre's mixes tiles changed to the sweep's
# choice (SPLIT 256, 32 tokens, 32 columns). GPU 1: the mHC kernel tests and tests/gpu
# (invariance 1..64 with graphs, prefill invariance, GPU path vs torch path). GPU 0, alone:
# bench/e2e.py decode and prefill (the transformers peer ran in the previous call). Carry .whl.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-230} python3 -m pytest -q -p no:cacheprovider -rf tests/ops/test_ops_mhc_triton.py tests/gpu \
    > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${E2E_S:-150} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --skip-transformers \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -8
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -10
