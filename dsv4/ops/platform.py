"""What the machine can run: accelerator kind, architecture, FP8 flavour, whether Triton kernels work.

``detect_platform()`` is cached (``detect_platform.cache_clear()`` re-reads the environment).

* CUDA: compute capability (sm_89+ has native OCP e4m3; older GPUs still run the Triton
  kernels, which decode FP8/FP4 bytes with integer arithmetic).
* ROCm: ``gcnArchName`` — gfx940/941/942 (MI300) use e4m3 **fnuz**; gfx950 (MI355) and
  RDNA4 (gfx12xx) have OCP e4m3; anything else (gfx90a, gfx936-class …) has no native FP8, and
  ``fp8_format`` is still "ocp" because the checkpoint and the compressed cache bytes are OCP.
* CPU: no native FP8; ``triton`` is True only under ``TRITON_INTERPRET=1`` (the interpreter,
  for correctness tests).

``DSV4_PLATFORM_FP8=ocp|fnuz`` forces ``fp8_format`` on any machine, so FNUZ paths are testable
everywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import env

__all__ = ["Platform", "detect_platform", "triton_importable", "interpreting"]

_FNUZ_ARCHES = ("gfx940", "gfx941", "gfx942")
_OCP_NATIVE_ARCHES = ("gfx950", "gfx1200", "gfx1201")


@dataclass(frozen=True)
class Platform:
    kind: str  # "cuda" | "rocm" | "cpu"
    name: str
    capability: tuple | None  # CUDA (major, minor); ROCm: torch's reported capability; CPU: None
    arch: str | None  # "sm_90", "gfx942", … ; None on CPU
    fp8_format: str | None  # "ocp" | "fnuz" (the encoding this platform's FP8 bytes use)
    native_fp8: bool  # hardware FP8 conversion / matrix instructions
    triton: bool  # Triton kernels can run (compiled, or interpreted on CPU)

    def describe(self) -> str:
        cap = "" if self.capability is None else f" cc={self.capability[0]}.{self.capability[1]}"
        return (f"{self.kind}:{self.name} arch={self.arch}{cap} fp8={self.fp8_format} "
                f"native_fp8={self.native_fp8} triton={self.triton}")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return env.triton_interpret()


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import time
        return False
    return True


def _rocm_fp8(arch: str) -> tuple[str, bool]:
    if arch in _FNUZ_ARCHES:
        return "fnuz", True
    if arch in _OCP_NATIVE_ARCHES:
        return "ocp", True
    return "ocp", False  # no native FP8 (gfx90a, gfx936-class …): bytes still OCP


def platform_from(kind: str, name: str = "", capability: tuple | None = None, arch: str | None = None,
                  triton: bool | None = None, fp8_format: str | None = None) -> Platform:
    """Build the Platform a machine of this kind/arch would report (used by detection and tests)."""
    if kind == "cuda":
        cap = tuple(capability) if capability is not None else (0, 0)
        arch = arch or f"sm_{cap[0]}{cap[1]}"
        fmt, native = "ocp", cap >= (8, 9)
        trit = triton_importable() if triton is None else triton
    elif kind == "rocm":
        arch = (arch or "").split(":")[0] or None
        fmt, native = _rocm_fp8(arch or "")
        cap = tuple(capability) if capability is not None else None
        trit = triton_importable() if triton is None else triton
    elif kind == "cpu":
        cap, arch, fmt, native = None, None, "ocp", False
        trit = (interpreting() and triton_importable()) if triton is None else triton
    else:
        raise ValueError(f"unknown platform kind {kind!r}; expected 'cuda', 'rocm' or 'cpu'")
    fmt = fp8_format or env.platform_fp8() or fmt
    return Platform(kind, name or kind, cap, arch, fmt, native, bool(trit))


@functools.lru_cache(maxsize=None)
def detect_platform() -> Platform:
    """The platform of the current default device (cached)."""
    if torch.cuda.is_available() and not interpreting():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        cap = (int(props.major), int(props.minor))
        if getattr(torch.version, "hip", None):
            return platform_from("rocm", props.name, cap, getattr(props, "gcnArchName", None) or "")
        return platform_from("cuda", props.name, cap)
    import platform as _pyplatform

    return platform_from("cpu", _pyplatform.processor() or _pyplatform.machine() or "cpu")
