#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 9, plus issue 8's GPU tests). Two canary trainings, one per GPU,
# both resumed from run 9 (out/canary_r9, carried) on the new recall format (a needle cluster in
# filler, docs/canary.md): A dense for the first half, far questions 150+ tokens back; B dense for
# the first 30 %, far questions 130-300 tokens back, higher LR. GPU 1 also runs tests/gpu (they
# were not rerun after last session's mHC tile change).
source bench/device_env.sh
train() {  # GPU NAME extra-args…
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout ${TRAIN_S:-480} python3 tools/train_canary.py --out /tmp/$name --device cuda \
    --resume ${RESUME:-out/canary_r9} --swiglu-limit 4 --budget-s ${BUDGET_S:-400} --save-every-s 100 --seqs 6 \
    --seq-len 3072 --recall-per-seq 4 --recall-len 300 800 --far-from 0 --qat-from 0.8 --warmup 10 --lr-floor 0.2 \
    --near-eval 32 --evals fp32/auto "$@" > /tmp/$name.out 2>&1
  echo "train $name exit $? at $(( $(date +%s) - T0 )) s" >> /tmp/$name.out
  grep -vE "Warning|warn" /tmp/$name.out > "$OUT/$name.log"
  [ -f /tmp/$name/config.json ] && tar -C /tmp -cf "$OUT/$name.tar" $name
}
train 0 canary_a --dense-until 0.5 --lr ${LR_A:-4e-4} &
train 1 canary_b --dense-until 0.3 --far-distance 130 300 --lr ${LR_B:-6e-4} &
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-420} python3 -m pytest -q -p no:cacheprovider -rf tests/gpu > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
for n in canary_a canary_b; do echo "== $n"; grep -E "step [0-9]*0 " "$OUT/$n.log" | awk 'NR%10==0' | cut -c1-200; tail -8 "$OUT/$n.log" | cut -c1-300; done
