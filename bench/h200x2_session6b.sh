#!/usr/bin/env bash
# One nvidia-h200-x2 call (issues 8, 9). GPU 1, correctness only: the kernel tests touched this
# session (MoE with the PTX MXFP4 decode, sparse attention with the 16-head default) and
# tests/gpu (graph batch invariance 1..64, prefill invariance, GPU path vs torch path), beside the
# canary's training resumed from run 8 (out/canary_r8, carried) with far recall just beyond the
# window (--far-distance 130 250). GPU 0, alone, timings: the MoE kernels (PTX vs portable decode,
# then the tile sweep), then bench/e2e.py with the transformers peer and a 64K prompt.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TRAIN_S:-470} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume ${RESUME:-out/canary_r8} \
    --swiglu-limit 4 --budget-s ${BUDGET_S:-400} --save-every-s 100 --seqs 6 --seq-len 3072 --recall-per-seq 4 \
    --recall-len 250 600 --far-distance 130 250 --far-from 0 --dense-until 0 --qat-from 0.75 --lr ${LR:-4e-4} \
    --warmup 10 --lr-floor 0.2 --near-eval 64 --evals fp32/auto --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-330} python3 -m pytest -q -p no:cacheprovider tests/ops/test_ops_moe_experts_triton.py \
    tests/ops/test_ops_sparse_attention_triton.py tests/gpu > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
timeout ${MOE_S:-200} python3 bench/kernels.py --only moe --out "$OUT/moe.json" > "$OUT/moe.log" 2>&1
echo "moe bench exit $? at $(( $(date +%s) - T0 )) s"; grep -E "moe_experts|copy|peak" "$OUT/moe.log" | cut -c1-170
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${E2E_S:-260} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --long-context 65536 \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -16
timeout ${SWEEP_S:-120} python3 bench/kernels.py --sweep --only moe --out "$OUT/moe_sweep.json" > "$OUT/moe_sweep.log" 2>&1
echo "moe sweep exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^sweep" "$OUT/moe_sweep.log" | cut -c1-300
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
echo "== canary at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/train.log" | cut -c1-300 | tail -6
