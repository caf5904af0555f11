"""A faster Triton interpreter for the CPU suite: the same kernels' values, less of the interpreter's overhead.

Under ``TRITON_INTERPRET=1`` the tests/ops kernels run as Python over numpy, and three parts of Triton's
interpreter cost more than the kernels' own numpy work:

* every call of a ``@triton.jit`` helper inside a kernel patches ``triton.language`` again
  (``inspect.getmembers`` over the language modules, per call, per program), although the launch's patch
  already covers it. A helper call whose modules the running launch has patched gets an empty patch scope
  here; the first helper of a launch to reach another module (``tl.sum`` reaches ``tl.core``) still runs
  Triton's own ``_patch_lang``. Triton never restores a nested patch and a repeat of it sets the same
  functions again, so the kernels see the same functions;
* bf16 <-> fp32 casts go through a generic bit-field converter: here they are the bit shifts they are
  (bf16 -> fp32 exact, fp32 -> bf16 truncated, as the interpreter's cast truncates). Every value converts
  as before except subnormals, which the generic converter gets wrong (bf16 0x0001 became 0.0) and the
  GPU's conversion gets right, as the shifts do;
* ``_get_np_dtype`` builds its type table on every call: memoized.

Each part is skipped (Triton's own behaviour kept) when this Triton lacks the internals it relies on.
"""

from __future__ import annotations


def install() -> list[str]:
    """Install what this Triton's interpreter allows; the names of the parts installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except Exception:  # no triton: nothing is interpreted
        return []
    return [name for name, part in (("nested_patch", _nested_patch), ("bf16_casts", _bf16_casts),
                                    ("np_dtype", _np_dtype)) if part(ti, tl)]


def _nested_patch(ti, tl) -> bool:
    real = getattr(ti, "_patch_lang", None)
    scope_type = getattr(ti, "_LangPatchScope", None)
    if real is None or scope_type is None or getattr(real, "_dsv4_fast", False):
        return False
    langs_of_launch: list[set] = []  # the language modules the running launch has patched
    langs_of: dict[int, set] = {}  # per globals dict (a module's): its language modules

    def langs(fn) -> set:
        g = getattr(fn, "__globals__", {})
        found = langs_of.get(id(g))
        if found is None:
            found = langs_of[id(g)] = {id(v) for v in g.values() if v is tl or v is tl.core}
        return found

    def patch_lang(fn):
        mine = langs(fn)
        if langs_of_launch:
            if mine <= langs_of_launch[-1]:
                return scope_type()
            langs_of_launch[-1] |= mine  # Triton's own nested patch, which stays
            return real(fn)
        scope = real(fn)
        restore = scope.restore

        def restore_and_end():
            try:
                restore()
            finally:
                langs_of_launch.clear()

        scope.restore = restore_and_end
        langs_of_launch.append(set(mine))
        return scope

    patch_lang._dsv4_fast = True
    ti._patch_lang = patch_lang
    return True


def _bf16_casts(ti, tl) -> bool:
    import numpy as np

    builder = getattr(ti, "InterpreterBuilder", None)
    handle = getattr(ti, "TensorHandle", None)
    real = getattr(builder, "cast_impl", None)
    if real is None or handle is None or getattr(real, "_dsv4_fast", False):
        return False

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and d == tl.float32:
            return handle((src.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32), d)
        if s == tl.float32 and d == tl.bfloat16:
            return handle((np.ascontiguousarray(src.data, np.float32).view(np.uint32) >> 16).astype(np.uint16), d)
        return real(self, src, dst_type)

    cast_impl._dsv4_fast = True
    builder.cast_impl = cast_impl
    return True


def _np_dtype(ti, tl) -> bool:
    real = getattr(ti, "_get_np_dtype", None)
    if real is None or getattr(real, "_dsv4_fast", False):
        return False
    memo: dict = {}

    def get_np_dtype(tt_dtype):
        try:
            return memo[tt_dtype]
        except KeyError:
            memo[tt_dtype] = found = real(tt_dtype)
            return found
        except TypeError:  # unhashable
            return real(tt_dtype)

    get_np_dtype._dsv4_fast = True
    ti._get_np_dtype = get_np_dtype
    return True
