"""Model weights for the reference path: checkpoint bytes → compute-dtype tensors.

FP8 block weights are dequantized once at load (the oracle computes dequantize-then-matmul);
routed experts stay in their checkpoint format (packed FP4 or FP8) and are dequantized when
an expert is used, optionally memoised. Every ``hc_*``, ``ape``, sink and gate bias stays fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.reader import Checkpoint
from ..config import ModelConfig
from ..formats import dequantize_block_fp8, dequantize_mxfp4


class ModelWeights:
    def __init__(self, ckpt: Checkpoint | str | Path, dtype: torch.dtype = torch.float32, device="cpu",
                 progress: bool = True, cache_experts: bool = True, names: list[str] | None = None):
        self.ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
        self.config: ModelConfig = self.ckpt.config
        self.dtype = dtype
        self.device = torch.device(device)
        self.cache_experts = cache_experts
        self.t: dict[str, torch.Tensor] = {}
        self._experts: dict[str, torch.Tensor] = {}
        specs = self.ckpt.specs
        wanted = [n for n in (names or specs) if specs[n].role not in ("fp8_scale", "fp4_scale")]
        wanted = [n for n in wanted if ".experts." not in n]
        it = wanted
        if progress:
            from tqdm import tqdm

            it = tqdm(wanted, desc="loading weights", unit="tensor", leave=False)
        for name in it:
            self.t[name] = self._load(name)

    def _load(self, name: str) -> torch.Tensor:
        spec = self.ckpt.specs[name]
        raw = self.ckpt.get(name)
        if spec.role == "fp8_weight":
            scale = self.ckpt.get(name[: -len(".weight")] + ".scale")
            return dequantize_block_fp8(raw.to(self.device), scale.to(self.device), out_dtype=self.dtype)
        if spec.role == "index":
            return raw.to(self.device, torch.long)
        if spec.role == "fp32":
            return raw.to(self.device, torch.float32)
        if raw.dim() == 1:  # norm weights: multiplied in fp32
            return raw.to(self.device, torch.float32)
        return raw.to(self.device, self.dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.t[name]

    def get(self, name: str, default=None):
        return self.t.get(name, default)

    def expert(self, prefix: str) -> torch.Tensor:
        """Dequantized routed-expert weight ``prefix`` (e.g. 'layers.3.ffn.experts.5.w1')."""
        w = self._experts.get(prefix)
        if w is not None:
            return w
        raw = self.ckpt.get(prefix + ".weight").to(self.device)
        scale = self.ckpt.get(prefix + ".scale").to(self.device)
        if self.config.expert_dtype == "fp4":
            w = dequantize_mxfp4(raw, scale, dtype=self.dtype)
        else:
            w = dequantize_block_fp8(raw, scale, out_dtype=self.dtype)
        if self.cache_experts:
            self._experts[prefix] = w
        return w
