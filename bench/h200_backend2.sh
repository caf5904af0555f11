#!/usr/bin/env bash
# Issue 8, device call 1: every kernel test compiled on the H200 (tests/ops), the GPU engine tests
# (fast path vs torch path, batch invariance 1..64, CUDA graphs), then bench/kernels.py (all suites).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
timeout ${TEST_S:-300} python3 -m pytest -q ${TESTS:-tests/ops tests/gpu} -p no:cacheprovider -s ${PYTEST_ARGS:--x} 2>&1 \
  | grep -vE "Warning|warn" | tail -${TEST_TAIL:-40}
[ "${SKIP_BENCH:-0}" = 1 ] || timeout ${BENCH_S:-200} python3 bench/kernels.py --quick --out "$OUT/kernels.json" 2>&1 | tail -80
