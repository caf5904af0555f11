#!/usr/bin/env bash
# Issue 11 on nvidia-h200-x2: tensor / expert parallelism over NCCL on two H200s.
#  1. a 4-layer flash-width checkpoint: TP=1 (graphs), TP=1 eager, TP=2, TP=2+EP; greedy equality
#     with TP=1, `dsv4 probe --tp 2`, decode b1/8/64, prefill 8K, the all-reduce share;
#  2. a 43-layer flash-width checkpoint (the release's depth and size, ~149 GiB: more than one H200
#     holds) in /dev/shm: TP=2 and TP=2+EP (greedy equality between the two, speed).
# NVLink multicast stays off in every process (also set inside bench/tp_gpu.py before torch loads).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
nvidia-smi topo -m 2>&1 | head -4
timeout ${SMALL_S:-270} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --out "$OUT/tp_small.json" \
  --config-timeout ${CONFIG_S:-75} --probe-timeout 90 2>&1 | grep -vE "Warning|warn" | tail -${SMALL_TAIL:-30}
[ "${SKIP_BIG:-0}" = 1 ] && exit 0
# the big checkpoint lives in RAM: /dev/shm grown to hold it (the disk is smaller than the model)
mount -o remount,size=${SHM_G:-200}G /dev/shm 2>&1
avail=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
layers=${BIG_LAYERS:-43}
if [ "$avail" -lt 160 ]; then layers=$(( (avail - 12) / 4 )); fi
echo "/dev/shm has ${avail} GiB free: ${layers} layers"
timeout ${BIG_S:-330} python3 bench/tp_gpu.py --ckpt /dev/shm/fw$layers --layers $layers --only tp2,tp2_ep \
  --skip-probe --decode-prompt-len 512 --steps 10 --config-timeout ${BIG_CONFIG_S:-150} --out "$OUT/tp_big.json" \
  2>&1 | grep -vE "Warning|warn" | tail -30
