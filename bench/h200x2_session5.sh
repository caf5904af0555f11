#!/usr/bin/env bash
# One nvidia-h200-x2 call (issues 11, 9): GPU 1 resumes the canary's training with the near-recall
# curriculum (docs/canary.md) for the whole call, while GPU 0 writes the 4-layer flash-width
# checkpoint and runs bench/probe_divergence.py (why the TP=1 bf16 probe parted from its oracle),
# then `dsv4 probe` at TP=2 bf16 on both GPUs (graphs on: its exit code shows the teardown).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
mkdir -p "$OUT/probe"
( CUDA_VISIBLE_DEVICES=1 timeout ${TRAIN_S:-540} python3 tools/train_canary.py --out /tmp/canary --device cuda \
    --resume dsv4/assets/canary --budget-s ${BUDGET_S:-420} --seqs 6 --seq-len 3072 --recall-per-seq 4 \
    --recall-len 150 400 --far-from 0.5 --dense-until 0.6 --qat-from 0.8 --lr 5e-4 --warmup 20 \
    --lr-floor 0.2 --evals fp32/auto --near-eval 64 --log "$OUT/train.log" > /tmp/train.out 2>&1
  echo "train exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/train.log"
  [ -f /tmp/canary/config.json ] && tar -C /tmp -cf "$OUT/canary.tar" canary ) &
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  CUDA_VISIBLE_DEVICES=0 python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
CUDA_VISIBLE_DEVICES=0 timeout ${DIV_S:-220} python3 bench/probe_divergence.py --ckpt /tmp/fw4 --out "$OUT/divergence.json" \
  2>&1 | grep -vE "Warning|warn|INFO" > "$OUT/divergence.log"
echo "divergence exit ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"; cut -c1-400 "$OUT/divergence.log" | tail -60
timeout ${PROBE_S:-230} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --only none --probe-tps 2 \
  --probe-timeout ${PROBE_S:-220} --out "$OUT/probe/tp.json" > "$OUT/probe/tp.log" 2>&1
grep -E "^probe|shutdown|destroy" "$OUT/probe/tp.log" | cut -c1-300 | tail -8
echo "probe done at $(( $(date +%s) - T0 )) s"
wait
echo "== canary"; grep -vE "Warning|warn" "$OUT/train.log" | cut -c1-300 | tail -10
