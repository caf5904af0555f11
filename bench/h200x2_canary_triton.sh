#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 9's last item): bench/h200_canary_triton.sh split over two GPUs —
# GPU 0 evaluates the embedded canary in float32, GPU 1 in bfloat16, each in both cache dtypes,
# with the Triton backend and --check (a task that drops more than the margin fails the run).
source bench/device_env.sh
run_pair() {  # $1 = GPU, $2 = compute dtype
  for kv in auto fp8_ds_mla; do
    CUDA_VISIBLE_DEVICES=$1 timeout ${EVAL_S:-270} python3 -m dsv4.cli eval canary --backend triton --dtype $2 \
      --kv-cache-dtype $kv --check --json-out "$OUT/canary_triton_$2_$kv.json" > "$OUT/canary_triton_$2_$kv.log" 2>&1
    echo "$2 $kv exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/summary_$2.txt"
  done
}
run_pair 0 float32 & run_pair 1 bfloat16 & wait
for dt in float32 bfloat16; do
  cat "$OUT/summary_$dt.txt"
  for kv in auto fp8_ds_mla; do grep -vE "Warning|warn" "$OUT/canary_triton_${dt}_${kv}.log" | tail -4 | cut -c1-300; done
done
