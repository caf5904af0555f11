"""Triton kernel specializations built in this process, counted (a build in a request's path is a stall).

Triton builds a kernel the first time it is launched with a new specialization (constexpr values,
argument dtypes, an integer's divisibility by 16): compiled from source, or loaded from its on-disk
cache. ``install()`` chains a counter onto Triton's post-compile hook; the engine installs it at
start, warms up, and reports the count (``dsv4:kernel_compiles``); after start-up the count must
not move. Under ``TRITON_INTERPRET=1`` nothing is built and the count stays 0.

``recording()`` lists the specialization key of every launch without a GPU (also under the
interpreter, where nothing is built): the key Triton's binder computes from the arguments — each
non-constexpr integer's class (1, divisible by 16, other; 32/64-bit), each tensor's dtype and 16-byte
alignment, the constexpr values and the launch options — so a test can show that a shape a request
brings produces no key the warm-up did not (``tests/ops/test_ops_specialization_keys.py``). Each key
comes with a picklable ``recipe`` from which ``build`` compiles the same specialization in another
process, with stand-in arguments (``engine.precompile``).

The on-disk cache is ``dsv4.env.kernel_cache_dir()`` (``TRITON_CACHE_DIR``, else
``$DSV4_CACHE_ROOT/triton``); ``install()`` points Triton at it, so a restart loads what the last start
built instead of compiling it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import threading
from collections import Counter, deque
from contextlib import contextmanager

from .. import env

_lock = threading.Lock()
_count = 0
_recent: deque = deque(maxlen=16)
_installed = False

def _record(name: str) -> None:
    global _count
    with _lock:
        _count += 1
        _recent.append(name)


def install() -> bool:
    """Count every specialization Triton builds from now on; False where Triton is not importable."""
    global _installed
    if _installed:
        return True
    env.use_kernel_cache_dir()
    try:
        import triton  # noqa: F401
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton (or too old for knobs): nothing is built either
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        _record(getattr(fn, "name", None) or "kernel")
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def count() -> int:
    """Specializations built since ``install()``."""
    return _count


def recent() -> list[str]:
    """The names of the last kernels built (newest last)."""
    with _lock:
        return list(_recent)


# ---- specialization keys, computed as Triton's binder computes them (no GPU needed) -------------

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")


@functools.cache
def _spec_impl():
    """Triton's own per-argument specialization (what its binder calls for every launch)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return lambda arg, spec, align: native_specialize_impl(BaseBackend, arg, False, spec, align)


def _params(kernel):
    """[(name, is_constexpr, specialize, align, default)] of a JIT kernel (compiled or interpreted)."""
    cached = getattr(kernel, "_dsv4_params", None)
    if cached is not None:
        return cached
    opts = getattr(kernel, "kwargs", None) or {}
    dns = getattr(kernel, "do_not_specialize", None) or opts.get("do_not_specialize") or ()
    dnsa = getattr(kernel, "do_not_specialize_on_alignment", None) or opts.get("do_not_specialize_on_alignment") or ()
    out = []
    for i, p in enumerate(inspect.signature(kernel.fn).parameters.values()):
        const = "constexpr" in str(p.annotation)
        default = None if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, const, not (i in dns or p.name in dns), not (i in dnsa or p.name in dnsa), default))
    kernel._dsv4_params = out
    return out


def _named(kernel, args, kwargs) -> dict:
    """A launch's arguments by parameter name (positional ones named), launch options included."""
    named = dict(zip((p[0] for p in _params(kernel)), args))
    named.update(kwargs)
    return named


def launch_key(kernel, args, kwargs) -> tuple:
    """(kernel name, per-argument specialization, options) of one launch: what selects its binary."""
    impl = _spec_impl()
    values = _named(kernel, args, kwargs)
    spec = []
    for name, const, specialize, align, default in _params(kernel):
        v = values.get(name, default)
        if const:
            spec.append((name, "constexpr", repr(v)))
        else:
            spec.append((name, *impl(v, specialize, align)))
    options = tuple(sorted((k, kwargs[k]) for k in _OPTIONS if k in kwargs))
    return (kernel.fn.__name__, tuple(spec), options)


def recipe(kernel, args, kwargs) -> tuple:
    """A picklable description of a launch from which ``build`` compiles the same specialization in another
    process: (module, kernel name, arguments by name — a tensor as (dtype, 16-byte aligned), anything else
    as it was — and the launch options)."""
    out = {}
    for name, v in _named(kernel, args, kwargs).items():
        if hasattr(v, "data_ptr") and hasattr(v, "dtype"):
            out[name] = ("tensor", str(v.dtype).replace("torch.", ""), v.data_ptr() % 16 == 0)
        else:
            out[name] = ("value", v)
    return (kernel.fn.__module__, kernel.fn.__name__, out)


class _MockTensor:
    """What Triton's binder reads of a tensor argument: its dtype and its address's alignment."""

    def __init__(self, dtype, aligned: bool):
        import torch

        self.dtype = getattr(torch, dtype)
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


def build(rec: tuple) -> tuple:
    """Compile the specialization ``recipe`` describes (no launch; the on-disk cache keeps it); returns its
    launch key, computed in this process (under the interpreter nothing is compiled)."""
    module, name, named = rec
    kernel = getattr(importlib.import_module(module), name)
    kwargs = {k: (_MockTensor(v[1], v[2]) if v[0] == "tensor" else v[1]) for k, v in named.items()}
    kernel.warmup(grid=(1,), **kwargs)
    return launch_key(kernel, (), kwargs)


def build_offline(rec: tuple, arch: int = 90) -> str:
    """Compile the specialization ``recipe`` describes for CUDA sm_``arch`` with no GPU (Triton's own ptxas, the
    binder's specialization rules as ``launch_key`` applies them): a kernel that builds under the interpreter but not
    for the GPU fails here, on any CPU machine (``tools/compile_offline.py``). Returns the kernel's name; raises what
    Triton raises. The process must not run the interpreter (its kernels are not JIT functions there)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    module, name, named = rec
    kernel = getattr(importlib.import_module(module), name)
    values = {k: (_MockTensor(v[1], v[2]) if v[0] == "tensor" else v[1]) for k, v in named.items()}
    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    signature, constexprs, attrs = {}, {}, {}
    for i, (pname, const, specialize, align, default) in enumerate(_params(kernel)):
        v = values.get(pname, default)
        kind, attr = ("constexpr", None) if const else native_specialize_impl(CUDABackend, v, False, specialize, align)
        signature[pname] = kind
        if kind == "constexpr":
            constexprs[(i,)] = v
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    options = backend.parse_options({k: values[k] for k in _OPTIONS if k in values})
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    return name


class Launches:
    """The launch keys seen inside ``recording()``: ``keys`` (a Counter), ``recipes`` (key → ``recipe``),
    ``new_since(other)``."""

    def __init__(self):
        self.keys: Counter = Counter()
        self.recipes: dict[tuple, tuple] = {}

    def kernels(self) -> set[str]:
        return {k[0] for k in self.keys}

    def new_since(self, seen) -> list[tuple]:
        """Keys not in ``seen`` (a Launches or a set of keys)."""
        base = seen.keys if isinstance(seen, Launches) else seen
        return [k for k in self.keys if k not in base]

    @staticmethod
    def diff(key: tuple, known) -> str:
        """One line: the arguments in which ``key`` differs from the nearest known key of its kernel."""
        same = [k for k in known if k[0] == key[0]]
        if not same:
            return f"{key[0]}: a kernel the warm-up never launched"
        near = min(same, key=lambda k: sum(a != b for a, b in zip(k[1], key[1])) + (k[2] != key[2]))
        d = [f"{a[0]}: {a[1:]} vs {b[1:]}" for a, b in zip(key[1], near[1]) if a != b]
        if key[2] != near[2]:
            d.append(f"options {key[2]} vs {near[2]}")
        return f"{key[0]}: " + "; ".join(d)


def jit_kernels(package: str = "dsv4.ops.triton") -> list:
    """Every JIT function (compiled or interpreted) defined in ``package``'s modules."""
    from triton.runtime.jit import KernelInterface

    pkg = importlib.import_module(package)
    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{package}.{info.name}")
        for v in vars(mod).values():
            if isinstance(v, KernelInterface) and getattr(v, "fn", None) is not None \
                    and v.fn.__module__ == mod.__name__ and v not in out:
                out.append(v)
    return out


@contextmanager
def recording(launch=True):
    """Record the key of every launch of a ``dsv4.ops.triton`` kernel; ``launch=False`` records without
    running the kernel (its outputs stay unwritten), a collection of kernels runs only those."""
    rec = Launches()
    patched = []
    for k in jit_kernels():
        orig = k.__dict__.get("run")

        def run(*args, grid, warmup, _k=k, _run=k.run, **kwargs):
            key = launch_key(_k, args, kwargs)
            if key not in rec.keys:
                rec.recipes[key] = recipe(_k, args, kwargs)
            rec.keys[key] += 1
            if warmup or (launch if isinstance(launch, bool) else _k in launch):
                return _run(*args, grid=grid, warmup=warmup, **kwargs)
            return None

        k.run = run
        patched.append((k, orig))
    try:
        yield rec
    finally:
        for k, orig in patched:
            if orig is None:
                del k.run
            else:
                k.run = orig
