"""Model weights: checkpoint bytes → what the ops consume.

Reference mode (``keep_quantized=False``): FP8 block weights are dequantized once at load (the
oracle computes dequantize-then-matmul); routed experts stay packed and are dequantized when an
expert is used, optionally memoised. Quantized mode (the GPU path): FP8 weights stay FP8 with
their block scales (:class:`FP8Weight`, consumed by the ``fp8_linear`` op) and each layer's
experts are stacked in their checkpoint format (no BF16 copy). Every ``hc_*``, ``ape``, sink and
gate bias stays fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.reader import Checkpoint
from ..config import ModelConfig
from ..formats import dequantize_block_fp8, dequantize_mxfp4
from ..formats.experts import stack_experts_from_checkpoint


class FP8Weight:
    """An FP8 E4M3 [N, K] weight with its 128×128 block scales (UE8M0 bytes as uint8, or fp32)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, op):
        self.weight, self.scale, self.op = weight, scale, op

    @property
    def shape(self):
        return self.weight.shape

    def rows(self, start: int, stop: int) -> "FP8Weight":
        if start % 128 or stop % 128:
            raise ValueError(f"FP8 weight row slice {start}:{stop} must align to 128-row scale blocks")
        return FP8Weight(self.weight[start:stop], self.scale[start // 128: stop // 128], self.op)

    def dequantize(self, dtype) -> torch.Tensor:
        return dequantize_block_fp8(self.weight, self.scale, out_dtype=dtype)


def stack_fp8_rows(w, key_a: str, key_b: str) -> tuple:
    """(a, b, [a; b]) for two FP8 weights that multiply the same input: one fp8_linear launch for both
    (at batch 1 a launch costs more than the bytes of such a weight). a and b become row views of the
    stacked weight, also in the weight store (``w.t``), so the model holds one copy. (a, b, None) unless
    both are ``FP8Weight``s with one op (the fast path; the oracle's weights are dequantized tensors) of
    one K, dtype and device, each of whole 128-row scale blocks (so b's scale rows follow a's)."""
    a, b = w[key_a], w[key_b]
    if not (isinstance(a, FP8Weight) and isinstance(b, FP8Weight) and a.op is not None and a.op is b.op):
        return a, b, None
    (na, k), nb = a.weight.shape, b.weight.shape[0]
    if (na % 128 or nb % 128 or b.weight.shape[1] != k or a.weight.dtype != b.weight.dtype
            or a.scale.dtype != b.scale.dtype or a.scale.shape[1:] != b.scale.shape[1:]
            or a.weight.device != b.weight.device):
        return a, b, None
    both = FP8Weight(torch.cat([a.weight, b.weight]), torch.cat([a.scale, b.scale]), a.op)
    a, b = both.rows(0, na), both.rows(na, na + nb)
    store = getattr(w, "t", None)
    if isinstance(store, dict):
        store[key_a], store[key_b] = a, b
    return a, b, both


class ModelWeights:
    def __init__(self, ckpt: Checkpoint | str | Path, dtype: torch.dtype = torch.float32, device="cpu",
                 progress: bool = True, cache_experts: bool = True, names: list[str] | None = None,
                 keep_quantized: bool = False, fp8_linear=None, shard=None):
        """``keep_quantized``: FP8 weights stay FP8 (``FP8Weight``, multiplied by ``fp8_linear``) and
        routed experts are stacked in their checkpoint format. ``shard``: tensor parallelism — an object
        whose ``read(ckpt, name)`` returns this rank's slice of a tensor and ``expert_range(n)`` its
        routed experts (``dsv4.parallel.group.TPGroup``)."""
        self.ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
        self.shard = shard
        self.config: ModelConfig = self.ckpt.config
        self.dtype = dtype
        self.device = torch.device(device)
        self.cache_experts = cache_experts
        self.keep_quantized = keep_quantized
        self.fp8_linear = fp8_linear
        self._stacked: dict[str, tuple] = {}
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
        raw = self._get(name)
        if spec.role == "fp8_weight":
            scale = self._get(name[: -len(".weight")] + ".scale")
            if self.keep_quantized:
                s = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale.float()
                return FP8Weight(raw.to(self.device), s.to(self.device), self.fp8_linear)
            return dequantize_block_fp8(raw.to(self.device), scale.to(self.device), out_dtype=self.dtype)
        if spec.role == "index":
            return raw.to(self.device, torch.long)
        if spec.role == "fp32":
            return raw.to(self.device, torch.float32)
        if raw.dim() == 1:  # norm weights: multiplied in fp32
            return raw.to(self.device, torch.float32)
        return raw.to(self.device, self.dtype)

    def _get(self, name: str) -> torch.Tensor:
        """The stored tensor, or under tensor parallelism this rank's shard of it (dsv4/parallel/shard.py)."""
        return self.ckpt.get(name) if self.shard is None else self.shard.read(self.ckpt, name)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.t[name]

    def get(self, name: str, default=None):
        return self.t.get(name, default)

    def expert(self, prefix: str) -> torch.Tensor:
        """Dequantized routed-expert weight ``prefix`` (e.g. 'layers.3.ffn.experts.5.w1')."""
        w = self._experts.get(prefix)
        if w is not None:
            return w
        raw = self._get(prefix + ".weight").to(self.device)
        scale = self._get(prefix + ".scale").to(self.device)
        if self.config.expert_dtype == "fp4":
            w = dequantize_mxfp4(raw, scale, dtype=self.dtype)
        else:
            w = dequantize_block_fp8(raw, scale, out_dtype=self.dtype)
        if self.cache_experts:
            self._experts[prefix] = w
        return w

    def stacked_experts(self, ffn_prefix: str) -> tuple:
        """(w13, s13, w2, s2) of one layer's routed experts in checkpoint format, stacked over
        experts (no dequantization; see :mod:`dsv4.formats.experts`)."""
        got = self._stacked.get(ffn_prefix)
        if got is None:
            n = self.config.n_routed_experts
            lo, hi = (0, n) if self.shard is None else self.shard.expert_range(n)  # EP: this rank's experts only
            got = stack_experts_from_checkpoint(self._get, ffn_prefix, hi - lo, self.device, first=lo)
            self._stacked[ffn_prefix] = got
        return got
