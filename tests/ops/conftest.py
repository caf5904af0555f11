"""tests/ops: Triton kernels vs the torch reference ops.

Without a GPU the Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before
any kernel module is imported (Triton reads it when a kernel is decorated). With a CUDA/ROCm GPU
the same tests run the compiled kernels on the device.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import install  # noqa: E402

    install()

from dsv4.ops.platform import detect_platform, triton_importable  # noqa: E402

detect_platform.cache_clear()
triton_importable.cache_clear()
