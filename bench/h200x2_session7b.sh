#!/usr/bin/env bash
# One nvidia-h200-x2 call (issues 8, 9). GPU 1: two canary trainings resumed from run 11b
# (out/canary_r11, carried; the first canary that answers far recall), consolidating over far
# questions 130-700 tokens back, sparse throughout: 12a LR 3e-4, 12b LR 2e-4 with QAT from half.
# GPU 0, alone: the MoE kernel tests (PTX decode) and bench/e2e.py at this tree, which last
# session's review commit left untested on the GPU.
source bench/device_env.sh
train() {  # GPU NAME extra-args…
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout ${TRAIN_S:-480} python3 tools/train_canary.py --out /tmp/$name --device cuda \
    --resume ${RESUME:-out/canary_r11} --swiglu-limit 4 --budget-s ${BUDGET_S:-400} --save-every-s 100 --seqs 6 \
    --seq-len 3072 --recall-per-seq 4 --recall-len 300 900 --far-distance 130 700 --far-from 0 --dense-until 0 \
    --warmup 10 --lr-floor 0.2 --near-eval 32 --evals fp32/auto "$@" > /tmp/$name.out 2>&1
  echo "train $name exit $? at $(( $(date +%s) - T0 )) s" >> /tmp/$name.out
  grep -vE "Warning|warn" /tmp/$name.out > "$OUT/$name.log"
  [ -f /tmp/$name/config.json ] && tar -C /tmp -cf "$OUT/$name.tar" $name
}
train 1 canary_12a --lr 3e-4 --qat-from 0.7 &
train 1 canary_12b --lr 2e-4 --qat-from 0.5 &
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/ops/test_ops_moe_experts_triton.py > "$OUT/moe_tests.log" 2>&1
echo "moe tests exit $? at $(( $(date +%s) - T0 )) s"; tail -2 "$OUT/moe_tests.log" | cut -c1-300
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${E2E_S:-250} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs --skip-transformers --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -12
wait
for n in canary_12a canary_12b; do echo "== $n"; grep -E "step [0-9]*00 " "$OUT/$n.log" | cut -c1-200; tail -4 "$OUT/$n.log" | cut -c1-300; done
