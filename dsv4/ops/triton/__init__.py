"""Triton kernels (import only where ``triton`` is importable: see ``dsv4.ops.platform``)."""
