#!/usr/bin/env bash
# One device call: the GPU-vs-oracle check, then bench/e2e.py (dsv4 vs transformers vs HBM bound).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -s tests/gpu -p no:cacheprovider 2>&1 | grep -E "rel err|passed|failed|Error" | head
timeout 440 python3 bench/e2e.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 --out "$OUT/e2e.json" 2>&1 | grep -v Warning | tail -25
