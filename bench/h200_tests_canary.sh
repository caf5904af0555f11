#!/usr/bin/env bash
# One nvidia-h200 call (correctness only): tests/gpu and the kernel tests not yet seen on the GPU,
# while the canary's resume training runs beside them; the new checkpoint comes back as canary.tar.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
( timeout ${TEST_S:-330} python3 -m pytest -q -rfE ${TESTS:-tests/gpu} -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
( timeout ${TRAIN_S:-320} python3 tools/train_canary.py --out /tmp/canary --device cuda --resume dsv4/assets/canary \
    --budget-s ${BUDGET_S:-250} --seqs 6 --seq-len 3072 --recall-per-seq 2 --dense-until 0 --qat-from 0.6 \
    --lr 4e-4 --warmup 10 --lr-floor 0.2 --evals fp32/auto --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
wait
echo "== tests"; grep -E "passed|failed|FAILED|ERROR|Error|exit|^E " "$OUT/tests.log" | cut -c1-300 | tail -30
echo "== canary"; grep -vE "Warning|warn" "$OUT/train.log" | cut -c1-300 | tail -5
