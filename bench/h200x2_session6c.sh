#!/usr/bin/env bash
# One nvidia-h200-x2 call (issues 8, 9). GPU 1, correctness only: tests/gpu and the sparse-attention
# kernel tests (after removing SPLIT_D), beside the canary's training resumed from run 9
# (out/canary_r9, carried): far recall just beyond the window, with masked-dense attention for the
# first half (the indexer is taught by the KL term before it gates what attention sees). GPU 0,
# alone, timings: bench/e2e.py with the transformers peer and a 64K prompt, then hc_pre's mixes
# tile sweep.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TRAIN_S:-470} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume ${RESUME:-out/canary_r9} \
    --swiglu-limit 4 --budget-s ${BUDGET_S:-400} --save-every-s 100 --seqs 6 --seq-len 3072 --recall-per-seq 4 \
    --recall-len 250 600 --far-distance 130 250 --far-from 0 --dense-until 0.5 --qat-from 0.8 --lr ${LR:-4e-4} \
    --warmup 10 --lr-floor 0.2 --near-eval 64 --evals fp32/auto > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> /tmp/train.out
  grep -vE "Warning|warn" /tmp/train.out | tail -40 > "$OUT/train_tail.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-400} python3 -m pytest -q -p no:cacheprovider -rf tests/gpu tests/ops/test_ops_sparse_attention_triton.py \
    > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${E2E_S:-260} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --long-context 65536 \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -9
timeout ${MHC_S:-100} python3 bench/kernels_mhc.py --sweep-mix --out "$OUT/mhc_sweep.json" > "$OUT/mhc_sweep.log" 2>&1
echo "mhc sweep exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^sweep" "$OUT/mhc_sweep.log" | cut -c1-330
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
echo "== canary at $(( $(date +%s) - T0 )) s"; tail -6 "$OUT/train_tail.log" | cut -c1-300
