#!/usr/bin/env bash
# One device call: per-op breakdown of a decode step on a flash-width checkpoint.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 400 python3 bench/decode_breakdown.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 --batches 1,64 --out "$OUT/breakdown.json" 2>&1 | grep -v Warning | tail -40
