"""Built-in backends: torch (always, priority 0) and Triton (priority 10, where Triton runs).

Triton backends are registered by module path, so nothing here imports Triton.
"""

from __future__ import annotations

from . import torch_ops
from .platform import Platform
from .registry import register

TORCH_PRIORITY = 0
TRITON_PRIORITY = 10


def _triton_ok(p: Platform) -> bool:
    return bool(p.triton)


register("fp8_linear", "torch", torch_ops.fp8_linear, lambda p: True, TORCH_PRIORITY)
register("moe_route", "torch", torch_ops.moe_route, lambda p: True, TORCH_PRIORITY)
register("moe_experts", "torch", torch_ops.moe_experts, lambda p: True, TORCH_PRIORITY)
# paged attention (signatures in dsv4.ops.torch_attention; by path: it imports the reference model)
register("kv_insert", "torch", "dsv4.ops.torch_attention:kv_insert", lambda p: True, TORCH_PRIORITY)
register("sparse_attention", "torch", "dsv4.ops.torch_attention:paged_sparse_attention", lambda p: True,
         TORCH_PRIORITY)
# the window KV: (pages, page_ids, offsets, kv_raw, norm_weight, eps, cos, sin, fmt, block_size) -> None,
# RMSNorm + RoPE + kv_insert (fused in one launch by the Triton backend)
register("kv_norm_rope_insert", "torch", "dsv4.ops.torch_attention:kv_norm_rope_insert", lambda p: True,
         TORCH_PRIORITY)
# the batched compressor's ring store + pooling + RMSNorm + RoPE + compressed-page insert (signature in
# dsv4.ops.torch_compressor)
register("compressor_pool_insert", "torch", "dsv4.ops.torch_compressor:compressor_pool_insert", lambda p: True,
         TORCH_PRIORITY)

# the sampler's plain greedy rows: logits [n, V] -> int64 [2, n] (first-argmax ids, all-finite flags)
register("greedy_pick", "torch", torch_ops.greedy_pick, lambda p: True, TORCH_PRIORITY)

register("fp8_linear", "triton", "dsv4.ops.triton.fp8_linear:fp8_linear", _triton_ok, TRITON_PRIORITY)
register("moe_route", "triton", "dsv4.ops.triton.moe:moe_route", _triton_ok, TRITON_PRIORITY)
register("moe_experts", "triton", "dsv4.ops.triton.moe:moe_experts", _triton_ok, TRITON_PRIORITY)
register("kv_insert", "triton", "dsv4.ops.triton.kv_insert:kv_insert", _triton_ok, TRITON_PRIORITY)
register("kv_norm_rope_insert", "triton", "dsv4.ops.triton.kv_insert:kv_norm_rope_insert", _triton_ok,
         TRITON_PRIORITY)
register("sparse_attention", "triton", "dsv4.ops.triton.sparse_attention:paged_sparse_attention", _triton_ok,
         TRITON_PRIORITY)
register("compressor_pool_insert", "triton", "dsv4.ops.triton.compressor:compressor_pool_insert", _triton_ok,
         TRITON_PRIORITY)
register("greedy_pick", "triton", "dsv4.ops.triton.greedy:greedy_pick", _triton_ok, TRITON_PRIORITY)

# Lightning Indexer over the paged indexer keys: (q, weights, seq_ids, n_visible, pages, block_table,
# entries_per_block, n_cols, k, fmt) -> top-k entry ids [T, k] (-1 padded)
register("indexer", "torch", "dsv4.ops.torch_indexer:paged_indexer_topk", lambda p: True, TORCH_PRIORITY)
register("indexer", "triton", "dsv4.ops.triton.indexer:paged_indexer_topk", _triton_ok, TRITON_PRIORITY)
# the indexer query: (q [T, H, D], cos, sin, fmt) -> fp32 q, roped (and FP8 fake-quantized when fmt is
# not None), one launch instead of ~40 small kernels a CSA layer
register("indexer_q_rope_quant", "torch", "dsv4.ops.torch_indexer:indexer_q_rope_quant", lambda p: True,
         TORCH_PRIORITY)
register("indexer_q_rope_quant", "triton", "dsv4.ops.triton.indexer_q:indexer_q_rope_quant", _triton_ok,
         TRITON_PRIORITY)

# the oracle's building blocks: their torch backends are the oracle's own functions (the reference op set's,
# ``dsv4.model.opset``: a composite such as mhc_pre runs over the set's other blocks)
for _op, _triton_fn in (
        ("mhc_pre", "dsv4.ops.triton.mhc:hc_pre"),
        ("mhc_post", "dsv4.ops.triton.mhc:hc_post"),
        ("mhc_post_pre", "dsv4.ops.triton.mhc:mhc_post_pre"),
        ("dense_linear", "dsv4.ops.triton.dense:dense_linear"),
        ("rms_norm", "dsv4.ops.triton.dense:rms_norm"),
        ("unit_rms_norm", "dsv4.ops.triton.dense:unit_rms_norm"),
        ("apply_rope", "dsv4.ops.triton.rope:apply_rope"),
        ("unit_norm_rope", "dsv4.ops.triton.rope:unit_norm_rope"),
        # the shared expert's clamped SwiGLU activation: (gate, up, limit, dtype) -> h, one launch
        ("swiglu_act", "dsv4.ops.triton.activation:swiglu_act")):
    register(_op, "torch", f"dsv4.model.opset:reference_{_op}", lambda p: True, TORCH_PRIORITY)
    register(_op, "triton", _triton_fn, _triton_ok, TRITON_PRIORITY)
