#!/usr/bin/env bash
# One device call: kernel tests on the real GPU, the GPU-vs-torch path check, and bench/kernels.py.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
timeout 200 python3 -m pytest -q -x tests/ops tests/gpu -p no:cacheprovider 2>&1 | tail -15
timeout 300 python3 bench/kernels.py --out "$OUT/kernels.json" 2>&1 | tail -60
