#!/usr/bin/env bash
# Issue 8, device call 2: bench/e2e.py on a 4-layer flash-width checkpoint — decode variants (CUDA
# graphs + batch-invariant tiles, eager, fastest tiles), prefill 1K/8K, a 64K prompt, transformers.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout ${E2E_S:-540} python3 bench/e2e.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 \
  --variants ${VARIANTS:-graphs,eager,fastest} --long-context ${LONG:-65536} ${E2E_ARGS:-} --out "$OUT/e2e.json" 2>&1 \
  | grep -vE "Warning|warn" | tail -40
