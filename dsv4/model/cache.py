"""Per-sequence attention state: the interface the model reads and writes, and a dense version.

The model addresses every cache kind by *absolute position* (raw tokens, compressor state rows)
or *compressed index* (compressed KV, indexer keys) of one sequence. The dense cache here keeps
plain tensors; the engine's paged cache implements the same methods over block-packed pages.
Both apply the cache numerics on write, so a read returns exactly what a reader of the stored
bytes would decode — for ``fp8_ds_mla`` that is the FP8/UE8M0-quantized NoPE with BF16 rope,
and the model attends to it even for the chunk that was just written.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..formats import FP8Format, fake_quant_indexer_k, fake_quant_kv, get_fp8_format

KV_CACHE_DTYPES = ("fp8_ds_mla", "auto")
KV_CACHE_ALIASES = {"fp8": "fp8_ds_mla"}  # vLLM canonicalises fp8 → fp8_ds_mla for this model


class CacheNumerics:
    """What the stored bytes round a value to, per cache kind."""

    def __init__(self, kv_cache_dtype: str = "fp8_ds_mla", fp8_format: str | FP8Format = "ocp"):
        kv_cache_dtype = KV_CACHE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (or 'fp8'), found {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.fmt = get_fp8_format(fp8_format)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype == "fp8_ds_mla"

    def kv(self, x: torch.Tensor, compressed: bool = False) -> torch.Tensor:
        """A 512-wide KV row as stored: FP8 NoPE per 64-tile + BF16 rope (or unchanged for auto)."""
        if not self.quantized:
            return x
        return fake_quant_kv(x.float(), self.fmt, round_bf16=compressed).to(x.dtype)

    def index_k(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return x
        return fake_quant_indexer_k(x.float(), self.fmt).to(x.dtype)


class SequenceCache(Protocol):
    numerics: CacheNumerics

    def write_kv(self, layer: int, positions: torch.Tensor, kv: torch.Tensor) -> None: ...
    def read_kv(self, layer: int, positions: torch.Tensor) -> torch.Tensor: ...
    def write_state(self, layer: int, kind: str, positions: torch.Tensor, rows: torch.Tensor) -> None: ...
    def read_state(self, layer: int, kind: str, positions: torch.Tensor) -> torch.Tensor: ...
    def write_compressed(self, layer: int, kind: str, index: torch.Tensor, entries: torch.Tensor) -> None: ...
    def read_compressed(self, layer: int, kind: str, index: torch.Tensor) -> torch.Tensor: ...


class _Rows:
    """Rows for a contiguous range of positions [base, base+len); appends only, trims from the front."""

    def __init__(self):
        self.base = 0
        self.data: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.base + (0 if self.data is None else self.data.shape[0])

    def write(self, pos: torch.Tensor, rows: torch.Tensor, what: str) -> None:
        start = int(pos[0])
        if self.data is None:
            self.base = start
        if start != self.end or int(pos[-1]) != start + len(pos) - 1:
            raise RuntimeError(f"{what}: non-contiguous write at {start}..{int(pos[-1])}, cache ends at {self.end}")
        self.data = rows if self.data is None else torch.cat([self.data, rows], dim=0)

    def read(self, pos: torch.Tensor, what: str) -> torch.Tensor:
        if self.data is None or int(pos.min()) < self.base or int(pos.max()) >= self.end:
            raise RuntimeError(
                f"{what}: read of {int(pos.min())}..{int(pos.max())} outside cached {self.base}..{self.end - 1}"
            )
        return self.data[pos - self.base]

    def trim(self, keep_from: int) -> None:
        if self.data is not None and keep_from > self.base:
            drop = min(keep_from - self.base, self.data.shape[0])
            self.data = self.data[drop:]
            self.base += drop


class DenseSequenceCache:
    """A plain-tensor cache for one sequence (the reference's own; no paging).

    Keeps only what the model can still read: the last ``window`` raw KV rows, the compressor
    state rows of the open block (plus the previous block for the overlapping ratio-4
    compressors), and every compressed entry.
    """

    def __init__(self, config, numerics: CacheNumerics | None = None):
        self.config = config
        self.numerics = numerics or CacheNumerics()
        self._kv: dict[int, _Rows] = {}
        self._state: dict[tuple[int, str], _Rows] = {}
        self._comp: dict[tuple[int, str], _Rows] = {}
        self.num_tokens = 0

    def _get(self, d, key):
        r = d.get(key)
        if r is None:
            r = d[key] = _Rows()
        return r

    def write_kv(self, layer, positions, kv):
        self._get(self._kv, layer).write(positions, self.numerics.kv(kv), f"layer {layer} window KV")

    def read_kv(self, layer, positions):
        return self._get(self._kv, layer).read(positions, f"layer {layer} window KV")

    def write_state(self, layer, kind, positions, rows):
        self._get(self._state, (layer, kind)).write(positions, rows.float(), f"layer {layer} {kind} compressor state")

    def read_state(self, layer, kind, positions):
        return self._get(self._state, (layer, kind)).read(positions, f"layer {layer} {kind} compressor state")

    def write_compressed(self, layer, kind, index, entries):
        stored = self.numerics.kv(entries, compressed=True) if kind == "kv" else self.numerics.index_k(entries)
        self._get(self._comp, (layer, kind)).write(index, stored, f"layer {layer} compressed {kind}")

    def read_compressed(self, layer, kind, index):
        return self._get(self._comp, (layer, kind)).read(index, f"layer {layer} compressed {kind}")

    def advance(self, n_tokens: int) -> None:
        """Called after a forward over ``n_tokens`` new tokens: drop rows no query can reach."""
        self.num_tokens += n_tokens
        end = self.num_tokens
        w = self.config.sliding_window
        for rows in self._kv.values():
            rows.trim(end - w)
        for (layer, _), rows in self._state.items():
            r = self.config.compress_ratio(layer)
            block_start = (end // r) * r
            rows.trim(block_start - r if r == 4 else block_start)


def advance_all(pairs) -> None:
    """``advance(n)`` of each (sequence cache, n) after one step, through the cache type's
    ``advance_many`` where it has one (the paged views commit all requests' state rows together)."""
    by_type: dict[type, list] = {}
    for cache, n in pairs:
        if hasattr(cache, "advance"):
            by_type.setdefault(type(cache), []).append((cache, n))
    for cls, items in by_type.items():
        many = getattr(cls, "advance_many", None)
        if many is not None:
            many(items)
        else:
            for cache, n in items:
                cache.advance(n)
