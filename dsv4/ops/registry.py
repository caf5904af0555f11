"""Op registry: each op has backends with an availability test and a priority.

``resolve(op)`` picks the highest-priority backend whose ``available(platform)`` is True, unless
the op is forced — by the ``force`` argument (a dict or a ``"op=backend,…"`` string) or by the
environment variable ``DSV4_OPS`` (same string form; ``force`` wins over the environment). A key
may name an op exactly (``moe_experts=torch``), a prefix group (``moe=triton`` covers
``moe_route`` and ``moe_experts``) or every op (``all=torch`` / ``*=torch``); exact names win
over groups. Forcing an op to a backend that is unknown or unavailable raises ``BackendError``
naming the op, the backend and the ones that are available.

A backend's ``fn`` may be a callable or a ``"module:attr"`` string imported on first resolve, so
registering a Triton backend never imports Triton.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .. import env
from ..model.opset import OPS
from .platform import Platform, detect_platform

__all__ = ["OPS", "BackendError", "Backend", "register", "resolve", "describe", "describe_table",
           "parse_force", "backends", "get", "unregister"]

ENV = "DSV4_OPS"


class BackendError(RuntimeError):
    pass


@dataclass
class Backend:
    op: str
    name: str
    fn: Callable | str
    available: Callable[[Platform], bool]
    priority: int

    def load(self) -> Callable:
        if isinstance(self.fn, str):
            mod, _, attr = self.fn.partition(":")
            try:
                self.fn = getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError) as e:
                raise BackendError(f"backend {self.name!r} of op {self.op!r} could not be loaded "
                                   f"from {self.fn!r}: {e}") from e
        return self.fn

    def is_available(self, platform: Platform) -> bool:
        try:
            return bool(self.available(platform))
        except Exception:
            return False


_REG: dict[str, dict[str, Backend]] = {}
_BUILTINS_LOADED = False


def _builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        importlib.import_module("dsv4.ops._builtin")


def register(op_name: str, backend_name: str, fn: Callable | str,
             available: Callable[[Platform], bool] | None = None, priority: int = 0) -> None:
    """Add (or replace) backend ``backend_name`` of ``op_name``."""
    if not op_name or not backend_name:
        raise ValueError("op_name and backend_name must be non-empty")
    _REG.setdefault(op_name, {})[backend_name] = Backend(
        op_name, backend_name, fn, available or (lambda p: True), int(priority))


def unregister(op_name: str, backend_name: str) -> None:
    """Remove a backend (no error if it is not registered)."""
    _REG.get(op_name, {}).pop(backend_name, None)


def backends(op_name: str) -> dict[str, Backend]:
    _builtins()
    if op_name not in _REG:
        raise BackendError(f"unknown op {op_name!r}; registered ops: {sorted(_REG)}")
    return _REG[op_name]


def parse_force(spec) -> dict[str, str]:
    """``"fp8_linear=torch, moe=triton"`` (or a dict) -> {key: backend}."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return {str(k).strip(): str(v).strip() for k, v in spec.items()}
    out = {}
    for item in str(spec).split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise BackendError(f"{ENV}: bad entry {item!r}; expected op=backend (e.g. 'fp8_linear=torch')")
        out[key.strip()] = val.strip()
    return out


def _forced_for(op_name: str, tables) -> str | None:
    """The backend forced for ``op_name``: the first table (argument, then environment) that names
    it exactly, by a group prefix (longest wins) or by 'all'/'*'."""
    if isinstance(tables, dict):
        tables = [tables]
    for table in tables:
        if op_name in table:
            return table[op_name]
        groups = [k for k in table if k not in ("all", "*") and op_name.startswith(k + "_")]
        if groups:
            return table[max(groups, key=len)]
        if "all" in table or "*" in table:
            return table.get("all", table.get("*"))
    return None


def _check_keys(table: dict[str, str], origin: str) -> None:
    ops = set(_REG)
    for key in table:
        if key in ("all", "*") or key in ops or any(op.startswith(key + "_") for op in ops):
            continue
        raise BackendError(f"{origin}: unknown op {key!r}; ops are {sorted(ops)} "
                           f"(or a group prefix such as 'moe', or 'all')")


def _force_table(force) -> list[dict[str, str]]:
    _builtins()
    arg = parse_force(force)
    _check_keys(arg, "force")
    forced = parse_force(env.ops_override())
    _check_keys(forced, ENV)
    return [arg, forced]


def _choose(op_name: str, platform: Platform, table: list[dict[str, str]]) -> tuple[Backend, str]:
    regs = backends(op_name)
    avail = sorted((b for b in regs.values() if b.is_available(platform)),
                   key=lambda b: (-b.priority, b.name))
    want = _forced_for(op_name, table)
    if want is not None:
        b = regs.get(want)
        if b is None:
            raise BackendError(f"op {op_name!r} forced to backend {want!r}, which is not registered; "
                               f"registered: {sorted(regs)}")
        if not b.is_available(platform):
            raise BackendError(f"op {op_name!r} forced to backend {want!r}, which is not available on "
                               f"{platform.describe()}; available: {[a.name for a in avail]}")
        return b, "forced"
    if not avail:
        raise BackendError(f"no backend of op {op_name!r} is available on {platform.describe()}")
    return avail[0], "priority"


def resolve(op_name: str, platform: Platform | None = None, force=None) -> tuple[str, Callable]:
    """(backend_name, fn) for ``op_name`` on ``platform`` (default: ``detect_platform()``)."""
    platform = platform or detect_platform()
    b, _ = _choose(op_name, platform, _force_table(force))
    return b.name, b.load()


def get(op_name: str, platform: Platform | None = None, force=None) -> Callable:
    """Just the function ``resolve`` picks."""
    return resolve(op_name, platform, force)[1]


def describe(platform: Platform | None = None, force=None) -> list[dict]:
    """One row per op: the chosen backend, why, and every registered backend with its state."""
    platform = platform or detect_platform()
    table = _force_table(force)
    rows = []
    for op in sorted(_REG, key=lambda o: (OPS.index(o) if o in OPS else len(OPS), o)):
        try:
            b, why = _choose(op, platform, table)
            chosen = b.name
        except BackendError as e:
            chosen, why = None, f"error: {e}"
        rows.append({
            "op": op, "backend": chosen, "reason": why,
            "candidates": [{"name": c.name, "priority": c.priority, "available": c.is_available(platform)}
                           for c in sorted(_REG[op].values(), key=lambda c: -c.priority)],
        })
    return rows


def describe_table(platform: Platform | None = None, force=None) -> str:
    """``describe()`` as text, for a one-time startup log line."""
    platform = platform or detect_platform()
    lines = [f"dsv4 ops on {platform.describe()}"]
    for r in describe(platform, force):
        cands = ", ".join(f"{c['name']}(p={c['priority']}{'' if c['available'] else ', unavailable'})"
                          for c in r["candidates"])
        lines.append(f"  {r['op']:<12} -> {r['backend']} [{r['reason']}]  candidates: {cands}")
    return "\n".join(lines)
