#!/usr/bin/env bash
# Issues 8 and 9 on nvidia-h200-x2, both GPUs at once:
#   GPU 1 (timings; nothing else on it): bench/e2e.py on a 4-layer flash-width checkpoint (decode
#         graphs / eager / fastest tiles, prefill 1K/8K, a 64K prompt, profiler breakdown,
#         transformers), then bench/kernels.py's attention suite;
#   GPU 0 (correctness; no timings): the canary's resume training, then `dsv4 eval canary` of the
#         new checkpoint on the GPU path; meanwhile the compiled kernel tests and tests/gpu.
# Results land in $OUT: e2e.json, kernels.json, canary.tar, train.log, tests.log, eval_*.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)

( export CUDA_VISIBLE_DEVICES=1
  timeout ${E2E_S:-420} python3 bench/e2e.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 \
    --variants ${VARIANTS:-graphs,eager,fastest} --long-context ${LONG:-65536} --out "$OUT/e2e.json" > /tmp/e2e.log 2>&1
  echo "e2e exit $? at $(( $(date +%s) - T0 )) s" >> /tmp/e2e.log
  timeout ${KBENCH_S:-100} python3 bench/kernels.py --quick --only attention,indexer --out "$OUT/kernels.json" > /tmp/kernels.log 2>&1
  echo "kernels exit $? at $(( $(date +%s) - T0 )) s" >> /tmp/kernels.log ) &
GPU1=$!

( export CUDA_VISIBLE_DEVICES=0
  timeout ${TRAIN_S:-470} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume dsv4/assets/canary \
    --budget-s ${BUDGET_S:-400} --seqs 6 --seq-len 3072 --recall-per-seq 2 --dense-until 0.4 --qat-from 0.75 \
    --lr 5e-4 --warmup 20 --lr-floor 0.2 --evals fp32/auto --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary
  for kv in fp8_ds_mla; do
    timeout ${EVAL_S:-60} python3 -m dsv4.cli eval canary --model /tmp/canary --kv-cache-dtype $kv \
      --json-out "$OUT/eval_gpu_$kv.json" > /tmp/eval_$kv.log 2>&1
    echo "eval $kv exit $? at $(( $(date +%s) - T0 )) s" >> /tmp/eval_$kv.log
  done ) &
GPU0=$!

( export CUDA_VISIBLE_DEVICES=0
  timeout ${TEST_S:-360} python3 -m pytest -q ${TESTS:-tests/ops tests/gpu} -p no:cacheprovider ${PYTEST_ARGS:-} \
    > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
TESTS_PID=$!

wait $TESTS_PID
echo "== tests (GPU 0)"; grep -E "passed|failed|error|FAILED|ERROR|exit" "$OUT/tests.log" | grep -v "Warning" | tail -25
wait $GPU0
echo "== canary training (GPU 0)"; grep -vE "Warning|warn" "$OUT/train.log" | tail -12
for f in /tmp/eval_*.log; do echo "== $f"; tail -c 700 "$f"; done
wait $GPU1
echo "== e2e (GPU 1)"; grep -vE "Warning|warn" /tmp/e2e.log | tail -45
echo "== kernels (GPU 1)"; grep -vE "Warning|warn" /tmp/kernels.log | tail -25
cp /tmp/e2e.log "$OUT/e2e.log" 2>/dev/null
