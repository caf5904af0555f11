"""The tensor inventory a config implies: every key of the release checkpoint, its dtype and shape.

The reader validates files against it and the synthetic generator writes exactly it, so the
two can never disagree about the format. Key names are the original DeepSeek ones
(``layers.N.attn.wq_a.weight``, ``ffn.experts.E.w1.scale``, ``mtp.0.e_proj.weight`` …).
For the full Flash config this yields 69,187 tensors, the count of the published index.

A DSpark config (0731) holds its drafter under the same ``mtp.`` namespace: stage m is a full
SWA block ``mtp.m.*`` at layer index ``num_hidden_layers + m``; stage 0 adds the context
projection ``main_proj`` (FP8, [H, n_target·H]) and ``main_norm``; the last stage adds the head
(``norm``, ``hc_head_*``), the Markov head ``markov_head.markov_w1`` (the previous token's
embedding, [V, r]) and ``markov_head.markov_w2`` (a [V, r] linear back to the vocabulary), both BF16,
and, optionally, ``confidence_head.proj`` ([1, H + r]). These names and placements are the ones the
public DSpark loaders (vLLM, SGLang) read from the release; a shape is the one its use implies.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import LayerType, ModelConfig

# safetensors dtype strings
F8 = "F8_E4M3"
E8M0 = "F8_E8M0"
BF16 = "BF16"
F32 = "F32"
I8 = "I8"
I32 = "I32"
I64 = "I64"

# The release stores these unquantized tensors in BF16; other producers use F32. Both load.
FLOATS = (BF16, F32)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # accepted dtypes; the first is what the release (and our generator) writes
    role: str  # "fp8_weight", "fp8_scale", "fp4_weight", "fp4_scale", "dense", "fp32", "index"

    @property
    def dtype(self) -> str:
        return self.dtypes[0]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.specs: dict[str, TensorSpec] = {}
        self.scale_dtype = E8M0 if cfg.quant.scale_fmt == "ue8m0" else F32

    def add(self, name: str, shape, dtypes, role: str) -> None:
        if isinstance(dtypes, str):
            dtypes = (dtypes,)
        self.specs[name] = TensorSpec(name, tuple(int(s) for s in shape), tuple(dtypes), role)

    def fp8_linear(self, prefix: str, out_f: int, in_f: int) -> None:
        self.add(f"{prefix}.weight", (out_f, in_f), F8, "fp8_weight")
        self.add(f"{prefix}.scale", (_cdiv(out_f, 128), _cdiv(in_f, 128)), self.scale_dtype, "fp8_scale")

    def expert(self, prefix: str, out_f: int, in_f: int) -> None:
        if self.cfg.expert_dtype == "fp4":
            self.add(f"{prefix}.weight", (out_f, in_f // 2), I8, "fp4_weight")
            self.add(f"{prefix}.scale", (out_f, in_f // 32), E8M0, "fp4_scale")
        else:
            self.fp8_linear(prefix, out_f, in_f)

    def norm(self, name: str, dim: int) -> None:
        self.add(name, (dim,), FLOATS, "dense")

    def hc(self, prefix: str, rows: int) -> None:
        c = self.cfg
        self.add(f"{prefix}_fn", (rows, c.hc_dim), F32, "fp32")
        self.add(f"{prefix}_base", (rows,), F32, "fp32")
        self.add(f"{prefix}_scale", (3 if rows == c.hc_mix_dim else 1,), F32, "fp32")

    def compressor(self, prefix: str, ratio: int, dim: int) -> None:
        coff = 2 if ratio == 4 else 1
        h = self.cfg.hidden_size
        self.add(f"{prefix}.wkv.weight", (coff * dim, h), FLOATS, "dense")
        self.add(f"{prefix}.wgate.weight", (coff * dim, h), FLOATS, "dense")
        self.add(f"{prefix}.ape", (ratio, coff * dim), F32, "fp32")
        self.norm(f"{prefix}.norm.weight", dim)

    def block(self, p: str, layer: int) -> None:
        """One decoder block (main layers and the MTP block share this)."""
        c = self.cfg
        h = c.hidden_size
        self.norm(f"{p}.attn_norm.weight", h)
        self.norm(f"{p}.ffn_norm.weight", h)
        self.hc(f"{p}.hc_attn", c.hc_mix_dim)
        self.hc(f"{p}.hc_ffn", c.hc_mix_dim)
        a = f"{p}.attn"
        self.fp8_linear(f"{a}.wq_a", c.q_lora_rank, h)
        self.norm(f"{a}.q_norm.weight", c.q_lora_rank)
        self.fp8_linear(f"{a}.wq_b", c.num_attention_heads * c.head_dim, c.q_lora_rank)
        self.fp8_linear(f"{a}.wkv", c.head_dim, h)
        self.norm(f"{a}.kv_norm.weight", c.head_dim)
        self.fp8_linear(f"{a}.wo_a", c.o_groups * c.o_lora_rank, c.heads_per_group * c.head_dim)
        self.fp8_linear(f"{a}.wo_b", h, c.o_groups * c.o_lora_rank)
        self.add(f"{a}.attn_sink", (c.num_attention_heads,), F32, "fp32")
        lt = c.layer_type(layer)
        if lt != LayerType.SWA:
            self.compressor(f"{a}.compressor", c.compress_ratio(layer), c.head_dim)
        if lt == LayerType.CSA:
            self.fp8_linear(f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            self.add(f"{a}.indexer.weights_proj.weight", (c.index_n_heads, h), FLOATS, "dense")
            self.compressor(f"{a}.indexer.compressor", 4, c.index_head_dim)
        f = f"{p}.ffn"
        self.add(f"{f}.gate.weight", (c.n_routed_experts, h), FLOATS, "dense")
        if c.is_hash_layer(layer):
            self.add(f"{f}.gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), (I64, I32), "index")
        else:
            self.add(f"{f}.gate.bias", (c.n_routed_experts,), F32, "fp32")
        inter = c.moe_intermediate_size
        if c.n_shared_experts:
            si = inter * c.n_shared_experts
            self.fp8_linear(f"{f}.shared_experts.w1", si, h)
            self.fp8_linear(f"{f}.shared_experts.w3", si, h)
            self.fp8_linear(f"{f}.shared_experts.w2", h, si)
        for e in range(c.n_routed_experts):
            self.expert(f"{f}.experts.{e}.w1", inter, h)
            self.expert(f"{f}.experts.{e}.w3", inter, h)
            self.expert(f"{f}.experts.{e}.w2", h, inter)


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the checkpoint for ``cfg`` must hold, keyed by name, in file order."""
    b = _Builder(cfg)
    h = cfg.hidden_size
    b.add("embed.weight", (cfg.vocab_size, h), FLOATS, "dense")
    for i in range(cfg.num_hidden_layers):
        b.block(f"layers.{i}", i)
    b.norm("norm.weight", h)
    b.add("head.weight", (cfg.vocab_size, h), FLOATS, "dense")
    b.hc("hc_head", cfg.hc_mult)
    for m in range(cfg.num_mtp_layers):
        p = f"mtp.{m}"
        b.block(p, cfg.num_hidden_layers + m)
        b.norm(f"{p}.enorm.weight", h)
        b.norm(f"{p}.hnorm.weight", h)
        b.fp8_linear(f"{p}.e_proj", h, h)
        b.fp8_linear(f"{p}.h_proj", h, h)
        b.hc(f"{p}.hc_head", cfg.hc_mult)
        b.norm(f"{p}.norm.weight", h)
    n = cfg.num_dspark_stages
    for m in range(n):
        p = f"mtp.{m}"
        b.block(p, cfg.num_hidden_layers + m)
        if m == 0:
            b.fp8_linear(f"{p}.main_proj", h, len(cfg.dspark_target_layer_ids) * h)
            b.norm(f"{p}.main_norm.weight", h)
        if m == n - 1:
            b.norm(f"{p}.norm.weight", h)
            b.hc(f"{p}.hc_head", cfg.hc_mult)
            r = cfg.dspark_markov_rank
            b.add(f"{p}.markov_head.markov_w1.weight", (cfg.vocab_size, r), FLOATS, "dense")
            b.add(f"{p}.markov_head.markov_w2.weight", (cfg.vocab_size, r), FLOATS, "dense")
    return b.specs


def optional_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Tensors a checkpoint may hold or leave out (validated when present): DSpark's confidence
    head, which not every DSpark release ships."""
    n = cfg.num_dspark_stages
    if not n:
        return {}
    b = _Builder(cfg)
    p = f"mtp.{n - 1}.confidence_head.proj"
    b.add(f"{p}.weight", (1, cfg.hidden_size + cfg.dspark_markov_rank), FLOATS, "dense")
    b.add(f"{p}.bias", (1,), FLOATS, "dense")
    return b.specs


def layer_of(name: str) -> str:
    """Group key for a tensor name: 'layers.3', 'mtp.0' or 'globals'."""
    parts = name.split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 1:
        return f"{parts[0]}.{parts[1]}"
    return "globals"
