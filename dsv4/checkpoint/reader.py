"""Lazy, validating reader for a DeepSeek-V4 model directory.

It parses the safetensors headers itself (cheap, no tensor bytes read) so that every problem
can be reported before anything is loaded and with full context: a truncated shard, a key
missing from the index or the files, a wrong dtype or shape. Tensor bytes are then memory-mapped
on demand through ``safetensors.safe_open``, and every tensor read is checked for NaN and ±inf
(:func:`non_finite_count`; one or two reductions per tensor), so that a corrupt weight fails the
load naming itself instead of failing a request, or quietly skewing outputs, later.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..config import ModelConfig, load_config
from .schema import TensorSpec, expected_tensors, optional_tensors

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2,
               "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint files do not match the format the config implies."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _smax(b: torch.Tensor) -> int:  # the largest byte read as int8 (0x7F: 127)
    return int(b.view(torch.int8).max())


def _smin(b: torch.Tensor) -> int:  # the smallest byte read as int8 (0x80: -128)
    return int(b.view(torch.int8).min())


# per FP8 / E8M0 dtype: what its non-finite codes are, which bytes they are, and a screen for them by
# one or two reductions (an int8 and a uint8 max or min): OCP E4M3 has NaN at S.1111.111 and no inf,
# E5M2 inf at S.11111.00 and NaN above it, the FNUZ encodings one NaN at 0x80 (negative zero's code),
# an E8M0 scale NaN at 0xFF
_CODES = {
    "F8_E4M3": ("NaN (FP8 E4M3 codes 0x7F/0xFF)", lambda b: (b & 0x7F) == 0x7F,
                lambda b: _smax(b) == 0x7F or int(b.max()) == 0xFF),
    "F8_E5M2": ("NaN or ±inf (FP8 E5M2 codes 0x7C-0x7F/0xFC-0xFF)", lambda b: (b & 0x7F) >= 0x7C,
                lambda b: _smax(b) >= 0x7C or int(b.max()) >= 0xFC),
    "F8_E4M3FNUZ": ("NaN (FP8 E4M3 FNUZ code 0x80)", lambda b: b == 0x80, lambda b: _smin(b) == -128),
    "F8_E5M2FNUZ": ("NaN (FP8 E5M2 FNUZ code 0x80)", lambda b: b == 0x80, lambda b: _smin(b) == -128),
    "F8_E8M0": ("NaN (E8M0 scale code 0xFF)", lambda b: b == 0xFF, lambda b: int(b.max()) == 0xFF),
}
_FLOATS = ("BF16", "F16", "F32", "F64")


def non_finite_count(t: torch.Tensor, dtype: str) -> tuple[int, str]:
    """(how many values of a stored tensor are not finite, what they are) by its safetensors ``dtype``:
    FP8 and E8M0 by their byte codes, floats by value. A cheap screen first (the byte reductions above;
    for floats the sum, which NaN and inf make non-finite); the values are counted only when it fires
    (a sum that merely overflowed counts 0)."""
    if t.numel() == 0:
        return 0, ""
    if dtype in _CODES:
        what, is_bad, screen = _CODES[dtype]
        b = t.view(torch.uint8)
        return (int(is_bad(b).sum()) if screen(b) else 0), what
    if dtype in _FLOATS:
        total = t.sum(dtype=torch.float32) if dtype == "F16" else t.sum()
        return (0 if torch.isfinite(total) else int((~torch.isfinite(t)).sum())), "NaN or ±inf"
    return 0, ""  # integers (packed FP4 experts, indices) have no non-finite codes


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one shard's header and check every tensor's byte range lies inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: truncated shard (file is {size} bytes, no header)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > size - 8:
            raise CheckpointError(f"{path.name}: truncated shard (header says {hlen} bytes, file has {size - 8})")
        try:
            header = json.loads(f.read(hlen))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path.name}: corrupt safetensors header ({e})") from e
    data_bytes = size - 8 - hlen
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if end > data_bytes:
            raise CheckpointError(
                f"tensor '{name}' in {path.name}: truncated shard (bytes {begin}..{end} but only {data_bytes} "
                "data bytes present)"
            )
        numel = 1
        for s in shape:
            numel *= s
        if dtype in DTYPE_BYTES and end - begin != numel * DTYPE_BYTES[dtype]:
            raise CheckpointError(
                f"tensor '{name}' in {path.name}: byte size {end - begin} does not match {dtype}{list(shape)}"
            )
        out[name] = TensorEntry(name, path, dtype, shape, end - begin)
    return out


def _shard_files(model_dir: Path) -> tuple[dict[str, str] | None, list[Path]]:
    idx = model_dir / INDEX_FILE
    if idx.exists():
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{idx}: unreadable index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                names = [k for k, v in weight_map.items() if model_dir / v == f]
                raise CheckpointError(
                    f"{INDEX_FILE} names shard {f.name}, which does not exist in {model_dir} "
                    f"(it maps {len(names)} tensor(s) there, e.g. '{names[0]}')"
                )
        return weight_map, files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no {INDEX_FILE} and no *.safetensors files in {model_dir}")
    return None, files


class Checkpoint:
    """A model directory: config + lazily opened tensors, validated against the config."""

    def __init__(self, model_dir: str | Path, config: ModelConfig | None = None, validate: bool = True,
                 check_finite: bool = True):
        """``check_finite``: every tensor read (``get``, ``get_slice``) is checked for NaN/±inf values, a
        :class:`CheckpointError` naming the tensor, its file and the count."""
        self.dir = Path(model_dir)
        self.check_finite = check_finite
        if not self.dir.is_dir():
            raise CheckpointError(f"model directory {self.dir} does not exist")
        self.config = config or load_config(self.dir)
        self.weight_map, self.files = _shard_files(self.dir)
        self.entries: dict[str, TensorEntry] = {}
        for f in self.files:
            for name, e in read_safetensors_header(f).items():
                if name in self.entries:
                    raise CheckpointError(
                        f"tensor '{name}' appears in both {self.entries[name].file.name} and {f.name}"
                    )
                self.entries[name] = e
        if self.weight_map is not None:
            for name, fname in self.weight_map.items():
                e = self.entries.get(name)
                if e is None:
                    raise CheckpointError(f"tensor '{name}': {INDEX_FILE} maps it to {fname}, but no shard holds it")
                if e.file.name != fname:
                    raise CheckpointError(f"tensor '{name}': {INDEX_FILE} maps it to {fname}, found in {e.file.name}")
            for name, e in self.entries.items():  # loaders that trust the index would not see it
                if name not in self.weight_map:
                    raise CheckpointError(f"tensor '{name}' in {e.file.name} is not listed in {INDEX_FILE}")
        self.specs = expected_tensors(self.config)
        self.specs.update({n: s for n, s in optional_tensors(self.config).items() if n in self.entries})
        self._handles: dict[Path, object] = {}
        if validate:
            self.validate()

    # ---- validation ----------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every mismatch between the files and the config's inventory, one line each."""
        out = []
        for name, spec in self.specs.items():
            e = self.entries.get(name)
            if e is None:
                out.append(f"missing tensor '{name}' (expected {spec.dtype}{list(spec.shape)}) in {self.dir}")
                continue
            if e.dtype not in spec.dtypes:
                out.append(f"tensor '{name}' in {e.file.name}: dtype expected {'|'.join(spec.dtypes)}, found {e.dtype}")
            if e.shape != spec.shape:
                out.append(
                    f"tensor '{name}' in {e.file.name}: shape expected {list(spec.shape)}, found {list(e.shape)}"
                )
        for name, e in self.entries.items():
            if name not in self.specs:
                out.append(
                    f"unexpected tensor '{name}' in {e.file.name} ({e.dtype}{list(e.shape)}): not in the config's "
                    "inventory"
                )
        return out

    def validate(self) -> None:
        probs = self.problems()
        if probs:
            more = f"\n  … and {len(probs) - 20} more" if len(probs) > 20 else ""
            raise CheckpointError(
                f"checkpoint {self.dir} is invalid ({len(probs)} problems):\n  " + "\n  ".join(probs[:20]) + more
            )

    # ---- access --------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def spec(self, name: str) -> TensorSpec:
        return self.specs[name]

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Load one tensor (memory-mapped), exactly as stored: fp8/e8m0/int8 dtypes preserved."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"tensor '{name}' is not in checkpoint {self.dir}")
        t = self._open(e).get_tensor(name)
        if self.check_finite:
            self._check_finite(e, t)
        return t.to(device) if str(device) != "cpu" else t

    def _check_finite(self, e: TensorEntry, t: torch.Tensor, part: str = "") -> None:
        n, what = non_finite_count(t, e.dtype)
        if n:
            raise CheckpointError(f"tensor '{e.name}' in {e.file.name}{part}: {n} of {t.numel()} values are {what} "
                                  f"({e.dtype}{list(e.shape)}); the checkpoint is corrupt")

    def non_finite(self, progress: bool = False) -> list[str]:
        """Every tensor holding NaN/±inf values, one line each (reads every tensor's bytes once)."""
        out, it = [], list(self.entries.values())
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="checking values", unit="tensor", leave=False)
        for e in it:
            try:
                self._check_finite(e, self._open(e).get_tensor(e.name))
            except CheckpointError as err:
                out.append(str(err))
        return out

    def _open(self, e: TensorEntry):
        from safetensors import safe_open

        h = self._handles.get(e.file)
        if h is None:
            h = self._handles[e.file] = safe_open(str(e.file), framework="pt", device="cpu")
        return h

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of one tensor, reading only those bytes
        (tensor-parallel ranks load their shard this way; see dsv4/parallel/shard.py). A fresh tensor."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"tensor '{name}' is not in checkpoint {self.dir}")
        if not (0 <= dim < len(e.shape) <= 2 and 0 <= start <= stop <= e.shape[dim]):
            raise CheckpointError(f"tensor '{name}' {list(e.shape)}: no slice [{start}, {stop}) along dim {dim}")
        sl = self._open(e).get_slice(name)
        # a copy: safetensors may hand out a view of the shared mmap, which callers must not modify
        t = (sl[start:stop] if dim == 0 else sl[:, start:stop]).clone(memory_format=torch.contiguous_format)
        if self.check_finite:
            self._check_finite(e, t, f" ({'rows' if dim == 0 else 'columns'} {start}..{stop})")
        return t

    def iter_tensors(
        self, names: list[str] | None = None, device="cpu", progress: bool = True, desc: str = "loading"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        names = list(self.specs) if names is None else names
        it = names
        if progress:
            from tqdm import tqdm

            it = tqdm(names, desc=desc, unit="tensor", leave=False)
        for n in it:
            yield n, self.get(n, device)

    def bytes_by_dtype(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for e in self.entries.values():
            c, b = out.get(e.dtype, (0, 0))
            out[e.dtype] = (c + 1, b + e.nbytes)
        return dict(sorted(out.items()))

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
