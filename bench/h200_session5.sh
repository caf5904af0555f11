#!/usr/bin/env bash
# One nvidia-h200 call (issues 11, 8, 9), correctness only (no timings): in the background the
# canary's training resumes from run 6 (out/canary_s5, carried) with far recall from the start;
# meanwhile `dsv4 probe` at TP=1 bf16 on the 4-layer flash-width checkpoint (with the float32
# re-judging of precision-conditioned steps), then tests/gpu (decode and prefill invariance,
# GPU path vs torch path).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
mkdir -p "$OUT/probe"
( timeout ${TRAIN_S:-500} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume ${RESUME:-out/canary_s5} \
    --budget-s ${BUDGET_S:-400} --seqs 6 --seq-len 3072 --recall-per-seq 4 --recall-len 150 400 --far-from 0 \
    --dense-until 0.5 --qat-from 0.8 --lr 4e-4 --warmup 10 --lr-floor 0.2 --near-eval 64 --evals fp32/auto \
    --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${PROBE_S:-240} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --only none --probe-tps 1 \
  --probe-timeout ${PROBE_S:-230} --out "$OUT/probe/tp.json" > "$OUT/probe/tp.log" 2>&1
grep -E "^probe" "$OUT/probe/tp.log" | cut -c1-300 | tail -4
echo "probe done at $(( $(date +%s) - T0 )) s"
timeout ${TEST_S:-200} python3 -m pytest -q tests/gpu -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | cut -c1-300 | tail -12
wait
echo "== canary"; grep -vE "Warning|warn" "$OUT/train.log" | cut -c1-300 | tail -6
