"""``dsv4 inspect``: a human summary of a model directory and its validation result."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from .reader import Checkpoint, CheckpointError


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n}"


def inspect_checkpoint(model_dir: str | Path, check_values: bool = True, progress: bool = False) -> tuple[str, bool]:
    """Return (report text, valid?). Never raises on a bad checkpoint: the report says why.
    ``check_values``: also read every tensor and report those holding NaN/±inf values."""
    lines = [f"model directory: {model_dir}"]
    try:
        ck = Checkpoint(model_dir, validate=False)
    except (CheckpointError, ValueError) as e:
        return "\n".join(lines + [f"INVALID: {e}"]), False
    c = ck.config
    lines += [
        f"config: hidden {c.hidden_size}, layers {c.num_hidden_layers}, heads {c.num_attention_heads}×{c.head_dim} "
        f"(rope {c.qk_rope_head_dim}), q_lora {c.q_lora_rank}, o {c.o_groups}×{c.o_lora_rank}, vocab {c.vocab_size}",
        f"moe: {c.n_routed_experts} experts top-{c.num_experts_per_tok} + {c.n_shared_experts} shared, inter "
        f"{c.moe_intermediate_size}, expert dtype {c.expert_dtype}, scales {c.quant.scale_fmt or 'float32'}, "
        f"hash layers {c.num_hash_layers}",
        f"attention: window {c.sliding_window}, indexer {c.index_n_heads}×{c.index_head_dim} top-{c.index_topk}, "
        f"mHC ×{c.hc_mult} ({c.hc_sinkhorn_iters} Sinkhorn iters)",
        f"rope: main θ={c.rope_main.theta:g}; compress θ={c.rope_compress.theta:g} "
        f"YaRN ×{c.rope_compress.yarn_factor:g} (orig {c.rope_compress.original_max_position}, "
        f"β {c.rope_compress.beta_fast:g}/{c.rope_compress.beta_slow:g})",
        f"mtp: {c.num_mtp_layers} layer(s)"
        + (f"; DSpark: {c.num_dspark_stages} stage(s), fields {sorted(c.dspark)}" if c.is_dspark else ""),
        f"layer schedule: {c.schedule_summary()}",
    ]
    counts = Counter(t.value for t in c.layer_types)
    lines.append("layer types: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines.append(f"files: {len(ck.files)} shard(s), {len(ck.entries)} tensors, {_fmt_bytes(ck.total_bytes())}")
    for dt, (n, b) in ck.bytes_by_dtype().items():
        lines.append(f"  {dt:8s} {n:7d} tensors  {_fmt_bytes(b)}")
    probs = ck.problems()
    if check_values:
        t0 = time.perf_counter()
        bad = ck.non_finite(progress=progress)
        probs += bad
        lines.append(f"values: {len(bad) or 'no'} tensor(s) with NaN/±inf values ({_fmt_bytes(ck.total_bytes())} "
                     f"read in {time.perf_counter() - t0:.2f} s)")
    if probs:
        lines.append(f"INVALID: {len(probs)} problem(s)")
        lines += [f"  {p}" for p in probs[:50]]
        return "\n".join(lines), False
    values = ", every value finite" if check_values else ""
    lines.append(f"VALID: all {len(ck.specs)} expected tensors present with the right dtype and shape{values}")
    return "\n".join(lines), True
