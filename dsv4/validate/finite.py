"""``--validate``: finite checks at every layer boundary and inside attention.

:class:`FiniteMonitor` installs itself on a :class:`~dsv4.model.model.ReferenceModel` through the
model's own hooks — ``set_hooks(fn)`` (``fn(name, tensor)`` for each attention's ``q``,
``k_window``, ``k_compressed``, ``logits`` and ``probs``) and the ``hook`` argument of
``forward`` (``hook(name, streams)`` after every layer), which it passes by wrapping the
*instance's* ``forward``. Checks run in forward order, so the first non-finite event names the
first layer/op that produced one: ``layers.2.attn.k_window`` means the decoded window keys of
layer 2 were already bad (a cache reader), ``layers.2`` with every attention check of layer 2
clean means the MoE / mHC part of that layer. :meth:`check_logits` covers the LM head output.

Nothing is installed unless ``install`` is called, so the engine pays nothing when validation
is off; ``uninstall`` restores the model exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FiniteEvent:
    name: str  # "layers.3.attn.k_window", "layers.3" (block output), "logits"
    context: str  # what the probe was doing ("generate bs=8", "reference")
    forward: int  # index of the model forward call within the monitor's life
    shape: tuple
    nan: int
    inf: int
    finite_absmax: float

    def describe(self) -> str:
        return (f"{self.name} during {self.context} (forward #{self.forward}): {self.nan} NaN, {self.inf} Inf "
                f"in {list(self.shape)}, finite |max| {self.finite_absmax:.4g}")

    def to_dict(self) -> dict:
        return {"name": self.name, "context": self.context, "forward": self.forward, "shape": list(self.shape),
                "nan": self.nan, "inf": self.inf, "finite_absmax": self.finite_absmax}


def _stats(t: torch.Tensor) -> tuple[int, int, float]:
    t = t.detach().float()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    fin = t[torch.isfinite(t)]
    return nan, inf, float(fin.abs().max()) if fin.numel() else float("nan")


@dataclass
class FiniteMonitor:
    """Record every non-finite tensor seen at a checkpoint; keep the first and a count."""

    context: str = ""
    max_events: int = 64
    events: list[FiniteEvent] = field(default_factory=list)
    checks: int = 0
    forwards: int = 0
    _installed: list = field(default_factory=list, repr=False)

    @property
    def first(self) -> FiniteEvent | None:
        return self.events[0] if self.events else None

    def check(self, name: str, t: torch.Tensor) -> bool:
        self.checks += 1
        if bool(torch.isfinite(t).all()):
            return True
        if len(self.events) < self.max_events:
            nan, inf, absmax = _stats(t)
            self.events.append(FiniteEvent(name, self.context, self.forwards, tuple(t.shape), nan, inf, absmax))
        return False

    def check_logits(self, logits: torch.Tensor) -> bool:
        return self.check("logits", logits)

    # ---- the model's hooks -------------------------------------------------------------------
    def _attn_hook(self, name: str, t: torch.Tensor) -> None:
        self.check(name, t)

    def _layer_hook(self, name: str, streams: torch.Tensor) -> None:
        self.check(name, streams)

    def install(self, model) -> "FiniteMonitor":
        """Hook ``model`` (a ReferenceModel): attention checks and the per-layer ``hook``."""
        if self._installed:
            raise RuntimeError("FiniteMonitor is already installed")
        model.set_hooks(self._attn_hook)
        inner = model.forward  # the bound method (or an earlier instance-level wrapper)
        had_own = "forward" in vars(model)
        layer_hook = self._layer_hook

        def forward(token_ids, chunks, logits_rows=None, hook=None, **kw):  # kw: paged, advance (engine)
            self.forwards += 1
            if hook is None:
                h = layer_hook
            else:
                def h(name, streams):
                    layer_hook(name, streams)
                    hook(name, streams)
            return inner(token_ids, chunks, logits_rows, hook=h, **kw)

        model.forward = forward
        self._installed = [model, inner if had_own else None]
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        model, own = self._installed
        model.set_hooks(None)
        if own is None:
            del model.forward
        else:
            model.forward = own
        self._installed = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()

    def to_dict(self) -> dict:
        return {"checks": self.checks, "forwards": self.forwards, "non_finite_events": len(self.events),
                "first": self.first.to_dict() if self.first else None,
                "events": [e.to_dict() for e in self.events[:16]]}
