#!/usr/bin/env bash
# One nvidia-h200-x2 call, both GPUs busy: GPU 0 checks that a prefill does not depend on the other
# requests of its step (bench/prefill_invariance.py, tiny + 4-layer flash-width; the TP=2 probe
# found batch-1 vs batch-8 first tokens that differ), then the GPU tests not yet run there; GPU 1
# resumes the canary's training with recall weighted up (docs/canary.md), then its tarball.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
( export CUDA_VISIBLE_DEVICES=0
  timeout ${DIAG_S:-300} python3 bench/prefill_invariance.py --ckpt /tmp/tiny --ckpt /tmp/fw4 --layers 4 \
    --out "$OUT/prefill_invariance.json" > "$OUT/diag.log" 2>&1
  echo "diag exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/diag.log"
  left=$(( ${TOTAL_S:-540} - ($(date +%s) - T0) ))
  [ "$left" -gt 60 ] && timeout $left python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu} > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TRAIN_S:-530} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume dsv4/assets/canary \
    --budget-s ${BUDGET_S:-420} --seqs 6 --seq-len 3072 ${TRAIN_ARGS:---recall-len 150 400 --recall-per-seq 4 --dense-until 0.4 --qat-from 0.75 --lr 5e-4 --warmup 20} \
    --lr-floor 0.2 --evals fp32/auto --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
wait
echo "== prefill invariance"; grep -vE "Warning|warn" "$OUT/diag.log" | cut -c1-900 | tail -12
echo "== tests"; grep -E "passed|failed|FAILED|ERROR|exit" "$OUT/tests.log" | cut -c1-300 | tail -15
echo "== canary"; grep -vE "Warning|warn" "$OUT/train.log" | cut -c1-300 | tail -8
