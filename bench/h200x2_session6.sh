#!/usr/bin/env bash
# One nvidia-h200-x2 call (issues 8, 9). GPU 1: the canary's training resumes from run 7
# (out/canary_r7, carried) at --swiglu-limit 4, so the trained function depends on the clamp.
# GPU 0, alone, timings: bench/kernels_attention.py (decode shapes + the prefill tile sweep, each
# config checked against torch), then bench/e2e.py at batch 1 / 64 and an 8K prefill with the
# per-kernel top list of each profile.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TRAIN_S:-470} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume ${RESUME:-out/canary_r7} \
    --swiglu-limit ${LIMIT:-4} --budget-s ${BUDGET_S:-400} --save-every-s 100 --seqs 6 --seq-len 3072 --recall-per-seq 4 \
    --recall-len 150 400 --far-from 0 --dense-until ${DENSE_UNTIL:-0.3} --qat-from 0.75 --lr ${LR:-4e-4} --warmup 10 \
    --lr-floor 0.2 --near-eval 64 --evals fp32/auto --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
export CUDA_VISIBLE_DEVICES=0
timeout ${ATTN_S:-240} python3 bench/kernels_attention.py --out "$OUT/attn.json" > "$OUT/attn.log" 2>&1
echo "attention bench exit $? at $(( $(date +%s) - T0 )) s"; cat "$OUT/attn.log" | cut -c1-200
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${E2E_S:-150} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --batches 1,64 --prefill 8192 --variants graphs \
  --skip-transformers --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/e2e.log" | cut -c1-160 | tail -80
wait
echo "== canary at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/train.log" | cut -c1-300 | tail -8
