#!/usr/bin/env bash
# Issue 11, one nvidia-h200-x2 call on a fresh machine: the 4-layer flash-width checkpoint's float32
# greedy check (TP=1 / TP=2 / TP=2+EP, where the layouts differ only in fp32 summation order) and
# `dsv4 probe` at each of $PROBES. If a float32 configuration fails on the default backend, the
# three run again on the torch backend, so the layouts are compared either way.
# Budgets from the 2026-11-29 runs: the first float32 configuration compiles the fp32 Triton
# kernels (over 90 s on a fresh machine); a probe at TP=2 took 110 s (bf16) and 191 s (float32).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
mkdir -p "$OUT/f32" "$OUT/f32t"
[ -f /tmp/fw4/model.safetensors.index.json ] || \
  CUDA_VISIBLE_DEVICES=0 python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
echo "checkpoint at $(( $(date +%s) - T0 )) s"
timeout ${F32_S:-540} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --only ${ONLY:-tp1_f32,tp2_f32,tp2_ep_f32} \
  --config-timeout ${CONFIG_S:-180} --probe-timeout ${PROBE_S:-200} --probe-tps ${PROBES:-2,1} \
  --out "$OUT/f32/tp.json" > "$OUT/f32/tp.log" 2>&1
grep -E "^\[|^config|^---|^tp|^probe|FAILED|OutOfResources" "$OUT/f32/tp.log" | cut -c1-300 | tail -30
echo "f32 + probes done at $(( $(date +%s) - T0 )) s"
if grep -q "FAILED: tp.*_f32" "$OUT/f32/tp.log"; then
  timeout ${F32T_S:-150} python3 bench/tp_gpu.py --ckpt /tmp/fw4 --layers 4 --only ${ONLY:-tp1_f32,tp2_f32,tp2_ep_f32} \
    --f32-backend torch --skip-probe --config-timeout 70 --out "$OUT/f32t/tp.json" > "$OUT/f32t/tp.log" 2>&1
  grep -E "^\[|^config|^---|^tp|FAILED" "$OUT/f32t/tp.log" | cut -c1-300 | tail -20
  echo "torch f32 done at $(( $(date +%s) - T0 )) s"
fi
