#!/usr/bin/env bash
# One nvidia-h200 call (issue 9's last item): the embedded canary's held-out accuracy through the
# engine with the Triton backend on the GPU, in both cache dtypes and both compute dtypes, next to
# the recorded CPU numbers (canary.json). --check fails a task that drops more than the margin.
source bench/device_env.sh
for dt in float32 bfloat16; do
  for kv in auto fp8_ds_mla; do
    timeout 240 python3 -m dsv4.cli eval canary --backend triton --dtype $dt --kv-cache-dtype $kv --check \
      --json-out "$OUT/canary_triton_${dt}_${kv}.json" > "$OUT/canary_triton_${dt}_${kv}.log" 2>&1
    echo "$dt $kv exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/canary_triton_${dt}_${kv}.log" | tail -3 | cut -c1-300
  done
done
