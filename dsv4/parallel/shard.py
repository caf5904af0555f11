"""Which slice of each checkpoint tensor a rank holds, read with safetensors' get_slice.

Sharding (N = tensor_parallel_size, r = this rank):

- attention: query heads split — ``wq_b`` rows and ``attn_sink`` by head. The grouped output
  projection follows the heads: with N ≤ o_groups a rank holds whole groups (``wo_a`` rows of
  its groups, ``wo_b`` columns of its groups); with N > o_groups (Flash's 8 groups at TP=16)
  N/o_groups ranks share one group: each holds that group's ``wo_a`` rows restricted to the
  columns of its own heads, and the group's ``wo_b`` columns. Either way every rank's output is
  a partial sum of the layer output (the projections are linear), all-reduced after ``wo_b``.
  The shared KV head (``wkv``), ``wq_a``, the compressors, the indexer, mHC and norms are
  replicated.
- MoE: gate / bias / hash table replicated (every rank routes every token). Routed experts are
  split by expert under EP (rank r reads only experts [r·E/N, (r+1)·E/N)), else each expert's
  intermediate dim is split (``w1``/``w3`` rows, ``w2`` columns). The shared expert is always
  intermediate-split. Expert and shared outputs are combined with one all-reduce.
- ``embed`` and ``head`` are vocab-parallel (rows [r·⌈V/N⌉, …)).

Block-scale alignment. FP8 weights carry one scale per 128×128 block, MXFP4 one per 32 inputs.
Attention shards are whole heads / groups (multiples of 128), so they are cut exactly and an
unaligned layout is refused. An intermediate-dim shard need not be aligned (the tiny model's 128
split in two is 64): the rank then reads the enclosing aligned range — rows/columns of whole
blocks, with their scales unchanged — and zeroes the rows/columns outside its shard. A zero
``w1``/``w3`` row gives a zero activation (silu(0)·0 = 0) that meets a zero ``w2`` column, so the
padding adds exactly nothing, the FP8/FP4 bytes and scales are the checkpoint's own, and the GPU
kernels see block-aligned shapes. (With ``act_quant`` the per-128 activation scale of a padded
block then covers fewer values than at TP=1; that simulation is per rank, as in vLLM.)
"""

from __future__ import annotations

import re

import torch

_ATTN = r"^(?:layers|mtp)\.\d+\.attn\."
_FFN = r"^(?:layers|mtp)\.\d+\.ffn\."
_RULES = [  # (pattern, kind, dim): kind names how the shard range is computed
    (re.compile(_ATTN + r"wq_b\.(?:weight|scale)$"), "heads_rows", 0),
    (re.compile(_ATTN + r"attn_sink$"), "heads", 0),
    (re.compile(_ATTN + r"wo_a\.(?:weight|scale)$"), "wo_a", 0),
    (re.compile(_ATTN + r"wo_b\.(?:weight|scale)$"), "wo_b", 1),
    (re.compile(_FFN + r"shared_experts\.w[13]\.(?:weight|scale)$"), "shared", 0),
    (re.compile(_FFN + r"shared_experts\.w2\.(?:weight|scale)$"), "shared", 1),
    (re.compile(_FFN + r"experts\.(\d+)\.w[13]\.(?:weight|scale)$"), "expert", 0),
    (re.compile(_FFN + r"experts\.(\d+)\.w2\.(?:weight|scale)$"), "expert", 1),
    (re.compile(r"^(?:embed|head)\.weight$"), "vocab", 0),
]

Ranges = list[tuple[int, int, int]]  # (dim, start, stop) in logical elements of the weight


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ShardPlan:
    def __init__(self, cfg, tp):
        self.cfg, self.tp = cfg, tp
        n, g = tp.world_size, cfg.o_groups
        tp.split(cfg.num_attention_heads, "num_attention_heads")
        if g % n and n % g:
            raise ValueError(f"o_groups={g} and tensor_parallel_size={n}: one must divide the other "
                             "(whole output groups per rank, or a group shared by N/o_groups ranks)")
        if cfg.n_shared_experts:
            tp.split(cfg.moe_intermediate_size * cfg.n_shared_experts, "shared expert intermediate size")
        if tp.ep:
            tp.split(cfg.n_routed_experts, "n_routed_experts (expert parallel)")
        else:
            tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        spans = [("query heads", cfg.num_attention_heads // n * cfg.head_dim),
                 ("o groups", max(1, g // n) * cfg.o_lora_rank)]
        for what, rows in spans:
            if rows % 128:
                raise ValueError(f"tensor_parallel_size={n}: each rank's {what} span {rows} rows, not a multiple of "
                                 "the 128-row FP8 scale block")

    def _group(self) -> tuple[int, int, int | None]:
        """(first group, groups held, this rank's column span inside its group's wo_a or None)."""
        c, tp = self.cfg, self.tp
        n, g = tp.world_size, c.o_groups
        if g % n == 0:
            lo, hi = tp.split(g, "o_groups")
            return lo, hi - lo, None
        k = n // g  # ranks per group
        return tp.rank // k, 1, tp.rank % k

    def ranges(self, name: str) -> Ranges | None:
        """This rank's shard of weight ``name``, or None for the whole tensor."""
        c, tp = self.cfg, self.tp
        for pat, kind, dim in _RULES:
            m = pat.match(name)
            if m is None:
                continue
            if kind == "heads_rows":
                lo, hi = tp.split(c.num_attention_heads, "num_attention_heads")
                return [(dim, lo * c.head_dim, hi * c.head_dim)]
            if kind == "heads":
                return [(dim, *tp.split(c.num_attention_heads, "num_attention_heads"))]
            if kind in ("wo_a", "wo_b"):
                first, count, part = self._group()
                rows = (dim, first * c.o_lora_rank, (first + count) * c.o_lora_rank)
                if kind == "wo_b" or part is None:
                    return [rows]
                width = c.num_attention_heads // tp.world_size * c.head_dim  # this rank's heads' columns
                return [rows, (1, part * width, (part + 1) * width)]
            if kind == "shared":
                return [
                    (dim, *tp.split(c.moe_intermediate_size * c.n_shared_experts, "shared expert intermediate size"))
                ]
            if kind == "expert":
                if tp.ep:
                    e = int(m.group(1))
                    lo, hi = tp.expert_range(c.n_routed_experts)
                    if not lo <= e < hi:
                        raise ValueError(
                            f"rank {tp.rank} holds experts [{lo}, {hi}) under expert parallelism; "
                            f"'{name}' belongs to another rank"
                        )
                    return None
                return [(dim, *tp.split(c.moe_intermediate_size, "moe_intermediate_size"))]
            if kind == "vocab":
                return [(dim, *tp.vocab_range(c.vocab_size))]
        return None

    def read(self, ckpt, name: str) -> torch.Tensor:
        """This rank's part of tensor ``name``: exact, or the aligned range with the rest zeroed.

        The first range is read from the file (only those rows/columns); a second one (a shared
        output group's columns) is cut in memory."""
        base = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name
        rs = self.ranges(base)
        if rs is None:
            return ckpt.get(name)
        t = None
        for dim, s, e in rs:
            t = self._read_1d(ckpt, name, base, dim, s, e, t)
        return t

    @staticmethod
    def _read_1d(ckpt, name, base, dim, s, e, t):
        """Slice [s, e) of ``dim``: from the file when ``t`` is None, else from ``t``."""

        def cut(lo, hi):
            if t is None:
                return ckpt.get_slice(name, dim, lo, hi)
            return t.narrow(dim, lo, hi - lo).clone(memory_format=torch.contiguous_format)

        role = ckpt.specs[name].role
        if role in ("dense", "fp32", "index"):
            return cut(s, e)
        align = 128 if role.startswith("fp8") else 32
        packed = ckpt.specs[base].role == "fp4_weight" and dim == 1
        full = ckpt.specs[base].shape[dim] * (2 if packed else 1)
        a0, a1 = s // align * align, min(full, _cdiv(e, align) * align)
        if role == "fp8_scale":
            return cut(a0 // 128, _cdiv(a1, 128))
        if role == "fp4_scale":
            return cut(a0 // 32, a1 // 32) if dim == 1 else cut(a0, a1)
        unit = 2 if packed else 1  # two E2M1 values per byte along the input dim
        if (s % unit) or (e % unit):
            raise ValueError(f"'{name}': shard [{s}, {e}) splits a packed FP4 byte")
        out = cut(a0 // unit, a1 // unit)
        if (a0, a1) != (s, e):
            b = out.view(torch.uint8)  # fp8 / int8 bytes: 0x00 is +0 in E4M3, E4M3-FNUZ and packed E2M1
            b.narrow(dim, 0, (s - a0) // unit).zero_()
            b.narrow(dim, (e - a0) // unit, (a1 - e) // unit).zero_()
        return out
