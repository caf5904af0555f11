#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 8, ninth session): the RoPE kernels, the Triton slot grouping,
# the stacked compressor GEMM, the routing-tile sweep.
# GPU 1: the new kernels' tests compiled, then tests/gpu (invariance 1..64, engine/path vs torch).
# GPU 0: the routing sweep and the grouping table (bench/kernels.py), bench/e2e.py (graphs),
# decode_sources at batch 1 and 64. Second call (after merging the swiglu / indexer-q fusions and the
# host-work branch): TESTS="tests/ops/test_ops_swiglu_act_triton.py tests/ops/test_ops_indexer_q_triton.py
# tests/ops/test_ops_moe_route_triton.py" SWEEP= E2E_ARGS="--long-context 65536" E2E_S=330 SOURCES=1.
source bench/device_env.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -rf ${TESTS:-tests/ops/test_ops_rope_triton.py \
    tests/ops/test_ops_moe_route_triton.py tests/ops/test_ops_dense_triton.py} > "$OUT/tests.log" 2>&1
  echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log"
  timeout ${GROUPT_S:-120} python3 -m pytest -q -p no:cacheprovider -rf tests/ops/test_ops_moe_experts_triton.py \
    -k "group" >> "$OUT/tests.log" 2>&1
  echo "grouping tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log"
  timeout ${GPU_S:-300} python3 -m pytest -q -p no:cacheprovider -rf tests/gpu >> "$OUT/tests.log" 2>&1
  echo "tests/gpu exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests.log" ) &
export CUDA_VISIBLE_DEVICES=0
python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
if [ -n "${SWEEP-1}" ]; then
  timeout ${SWEEP_S:-120} python3 bench/kernels.py --sweep --only route --out "$OUT/route_sweep.json" > "$OUT/route_sweep.log" 2>&1
  echo "route sweep exit $? at $(( $(date +%s) - T0 )) s"; grep -iE "best|T *=|fail|error" "$OUT/route_sweep.log" | cut -c1-160 | tail -24
  timeout ${GROUP_S:-90} python3 bench/kernels.py --only group --out "$OUT/group.json" > "$OUT/group.log" 2>&1
  echo "group table exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/group.log" | cut -c1-160 | tail -12
fi
timeout ${E2E_S:-200} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs ${E2E_ARGS:---skip-transformers} \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -7
python3 - "$OUT/e2e.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))["dsv4"]
for k in ("profile_b1_graphs", "profile_b64_graphs", "profile_prefill_8192"):
    print(k, {a[:22]: b for a, b in d.get(k, {}).items()})
for k in ("top_kernels_b1_graphs", "top_kernels_prefill_8192"):
    print(k); [print("  %8.3f %4d %s" % (r[0], r[1], r[2][:90])) for r in d.get(k, [])[:14]]
PY
for b in ${SOURCES-1 64}; do
  timeout ${SRC_S:-60} python3 bench/decode_sources.py --ckpt /tmp/fw4 --batch $b --top 40 --out "$OUT/sources_b$b.json" \
    > "$OUT/sources_b$b.log" 2>&1
  echo "sources b$b exit $? at $(( $(date +%s) - T0 )) s"; head -14 "$OUT/sources_b$b.log" | cut -c1-160
done
wait
echo "== tests"; grep -E "passed|failed|FAILED|Error|exit" "$OUT/tests.log" | cut -c1-300 | tail -20
