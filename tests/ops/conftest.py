"""tests/ops: Triton kernels vs the torch reference ops.

Without a GPU the Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before
any kernel module is imported (Triton reads it when a kernel is decorated). With a CUDA/ROCm GPU
the same tests run the compiled kernels on the device.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4.ops.platform import detect_platform, triton_importable  # noqa: E402

detect_platform.cache_clear()
triton_importable.cache_clear()


def _skip_nested_lang_patches() -> None:
    """Under the interpreter every call of a @triton.jit helper inside a kernel patches triton.language again
    (``_patch_lang``: ``inspect.getmembers`` over tl, tl.tensor, tl.math…, ~2 ms), although the kernel's launch
    patched the same modules already and restores them when it ends; the nested scope is never restored.
    Measured: 19 of the 60 s of an mHC post_pre test. Here a nested call patches only if its globals hold a
    language module (tl or tl.core) not patched since the launch began; otherwise it gets a scope with nothing
    to restore. The interpreted functions are the same either way, so are the results. If Triton's interpreter
    no longer has this shape, nothing is changed."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    orig = getattr(ti, "_patch_lang", None)
    if orig is None or getattr(orig, "_dsv4_skips_repeats", False):
        return
    state = {"depth": 0, "patched": set()}

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}
        if state["depth"] and langs <= state["patched"]:
            return _Nothing()
        scope = orig(fn)
        state["patched"] |= langs
        if state["depth"]:  # a nested call: upstream leaves its scope unrestored too
            return scope
        state["depth"] = 1
        restore = scope.restore

        def restore_launch() -> None:
            state["depth"], state["patched"] = 0, set()
            restore()

        scope.restore = restore_launch
        return scope

    patch_lang._dsv4_skips_repeats = True
    ti._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_nested_lang_patches()
