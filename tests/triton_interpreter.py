"""A faster Triton interpreter for the CPU suite: a jit helper called inside a kernel skips re-patching.

Under ``TRITON_INTERPRET=1`` every launch patches ``triton.language`` (its builtins become numpy
implementations) and restores it afterwards; every call of a ``@triton.jit`` helper inside the kernel patches
it again (``inspect.getmembers`` over the language modules, per call, per program), although the launch's
patch already covers it: a quarter of an interpreted test's time (the mHC model test: 21 of 79 s in
``_patch_builtin``). Here a helper call whose modules the running launch has patched gets an empty patch scope
instead; anything else (a launch, the first helper of the launch to reach another module: ``tl.sum`` reaches
``tl.core``) runs Triton's own ``_patch_lang``. Triton's nested patch is never restored and a repeat of it
sets the same functions again, so skipping the repeats leaves every kernel computing the same values.
Skipped (Triton's behaviour kept) when this Triton's interpreter lacks the internals it relies on.
"""

from __future__ import annotations


def install() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang``; True when installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except Exception:  # no triton: nothing is interpreted
        return False
    real = getattr(ti, "_patch_lang", None)
    scope_type = getattr(ti, "_LangPatchScope", None)
    if real is None or scope_type is None or getattr(real, "_dsv4_nested_skip", False):
        return False
    langs_of_launch: list[set] = []  # the language modules the running launch patched

    def langs(fn) -> set:
        return set(id(v) for v in getattr(fn, "__globals__", {}).values() if v is tl or v is tl.core)

    def patch_lang(fn):
        mine = langs(fn)
        if langs_of_launch:
            if mine <= langs_of_launch[-1]:
                return scope_type()
            langs_of_launch[-1] |= mine  # Triton's own nested patch (``tl.core`` for ``tl.sum``): it stays
            return real(fn)
        scope = real(fn)
        restore = scope.restore

        def restore_and_end():
            try:
                restore()
            finally:
                langs_of_launch.clear()

        scope.restore = restore_and_end
        langs_of_launch.append(mine)
        return scope

    patch_lang._dsv4_nested_skip = True
    ti._patch_lang = patch_lang
    return True
