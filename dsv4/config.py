"""Model configuration: read a DeepSeek-V4 ``config.json`` and derive what the code needs.

The release config speaks in legacy keys (``compress_ratios``, ``num_hash_layers``,
``rope_scaling``); everything downstream asks per-layer questions ("is layer 7 CSA?", "which
RoPE does it use?"), so this module answers them once and validates the file on the way in.
A missing or contradictory field is a :class:`ConfigError` that names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json field is missing, malformed or contradicts another field."""


class LayerType(str, Enum):
    SWA = "sliding_attention"  # compress ratio 0: only the 128-token raw window
    CSA = "compressed_sparse_attention"  # ratio 4 + Lightning Indexer top-k
    HCA = "heavily_compressed_attention"  # ratio 128, all compressed entries


RATIO_TO_TYPE = {0: LayerType.SWA, 4: LayerType.CSA, 128: LayerType.HCA}
# Small models (the embedded canary) may use a finer HCA ratio so compression matters at a few
# hundred tokens: any power of two that divides the 256-token cache block and exceeds 4 (the
# block then holds 256/ratio whole entries and the state ring holds one open block).
SMALL_HCA_RATIOS = (8, 16, 32, 64, 256)


def ratio_type(ratio: int) -> LayerType:
    """Layer type of a compress ratio (validated by :func:`config_from_dict`)."""
    return LayerType.HCA if ratio in SMALL_HCA_RATIOS else RATIO_TO_TYPE[ratio]


@dataclass(frozen=True)
class RopeParams:
    """One RoPE variant. ``yarn_factor == 1`` means plain RoPE."""

    theta: float
    dim: int
    yarn_factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self):
        """Per-pair inverse frequencies (float64 math, returned as float32 tensor).

        YaRN blends the extrapolated frequency with freq/factor using a linear ramp
        between the correction dims; there is no magnitude scaling (mscale = 1).
        """
        import torch

        half = self.dim // 2
        i = torch.arange(half, dtype=torch.float64)
        base = 1.0 / (self.theta ** (2 * i / self.dim))
        if self.yarn_factor == 1.0:
            return base.float()
        low, high = self.yarn_correction_range()
        ramp = ((i - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1.0 - ramp  # 1 → original frequency, 0 → interpolated
        return (base / self.yarn_factor * (1 - keep) + base * keep).float()

    def yarn_correction_range(self) -> tuple[int, int]:
        def dim_for(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low = math.floor(dim_for(self.beta_fast))
        high = math.ceil(dim_for(self.beta_slow))
        return max(low, 0), min(high, self.dim - 1)


@dataclass(frozen=True)
class QuantConfig:
    block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = "ue8m0"  # None → float32 scales (Base checkpoint)
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: tuple[int, ...]  # one per main layer (MTP entries split off)
    mtp_compress_ratios: tuple[int, ...]  # entries past num_hidden_layers
    num_hash_layers: int
    num_nextn_predict_layers: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeParams
    rope_compress: RopeParams
    max_position_embeddings: int
    expert_dtype: str  # "fp4" | "fp8"
    quant: QuantConfig
    bos_token_id: int
    eos_token_id: int
    tie_word_embeddings: bool
    dspark: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_mtp_layers(self) -> int:
        """Classic MTP layers the checkpoint carries (0 when the mtp namespace is DSpark)."""
        return 0 if self.is_dspark else self.num_nextn_predict_layers

    @property
    def is_dspark(self) -> bool:
        return bool(self.dspark)

    @property
    def num_dspark_stages(self) -> int:
        """DSpark draft layers (``mtp.0..``): the ``compress_ratios`` entries past the main stack."""
        return len(self.mtp_compress_ratios) if self.is_dspark else 0

    @property
    def num_draft_layers(self) -> int:
        """SWA-only layers past the main stack that keep a window cache (classic MTP or DSpark)."""
        return self.num_mtp_layers + self.num_dspark_stages

    @property
    def dspark_block_size(self) -> int:
        return int(self.dspark.get("dspark_block_size", 0))

    @property
    def dspark_noise_token_id(self) -> int:
        return int(self.dspark.get("dspark_noise_token_id", 0))

    @property
    def dspark_target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.dspark.get("dspark_target_layer_ids", ()))

    @property
    def dspark_markov_rank(self) -> int:
        return int(self.dspark.get("dspark_markov_rank", 0))

    def layer_type(self, layer: int) -> LayerType:
        if layer >= self.num_hidden_layers:  # MTP / DSpark layers are sliding-window only
            return LayerType.SWA
        return ratio_type(self.compress_ratios[layer])

    def compress_ratio(self, layer: int) -> int:
        return 0 if layer >= self.num_hidden_layers else self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers  # MTP layers (index ≥ n_layers) are never hash-routed

    def rope(self, layer: int) -> RopeParams:
        return self.rope_main if self.compress_ratio(layer) == 0 else self.rope_compress

    @property
    def layer_types(self) -> list[LayerType]:
        return [self.layer_type(i) for i in range(self.num_hidden_layers)]

    def schedule_summary(self) -> str:
        short = {LayerType.SWA: "SWA", LayerType.CSA: "CSA", LayerType.HCA: "HCA"}
        parts = []
        for i in range(self.num_hidden_layers):
            tag = short[self.layer_type(i)] + ("+hash" if self.is_hash_layer(i) else "")
            parts.append(f"{i}:{tag}")
        if self.num_mtp_layers:
            parts.append(f"mtp×{self.num_mtp_layers}:SWA")
        if self.is_dspark:
            parts.append(f"dspark×{len(self.mtp_compress_ratios)}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


_REQUIRED_INT = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "num_hash_layers",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "hc_mult",
    "hc_sinkhorn_iters",
]


def _get(d: dict, key: str, kind: type | tuple, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise ConfigError(f"config.json: missing required field '{key}'")
        return default
    v = d[key]
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ConfigError(f"config.json: field '{key}' must be {getattr(kind, '__name__', kind)}, found {v!r}")
    return v


_DSPARK_REQUIRED = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")


def _check_dspark(d: dict[str, Any], n_layers: int, vocab: int, n_stages: int) -> None:
    """A DSpark config (any ``dspark_*`` field) has all four fields, each in range, and its stages
    as ``compress_ratios`` entries past the main layers."""
    for k in _DSPARK_REQUIRED:
        if k not in d:
            raise ConfigError(f"config.json: DSpark field '{k}' is missing (the config has "
                              f"{sorted(k2 for k2 in d if k2.startswith('dspark_'))})")
    for k in ("dspark_block_size", "dspark_markov_rank"):
        if _get(d, k, int) <= 0:
            raise ConfigError(f"config.json: field '{k}' must be positive, found {d[k]}")
    noise = _get(d, "dspark_noise_token_id", int)
    if not 0 <= noise < vocab:
        raise ConfigError(f"config.json: field 'dspark_noise_token_id' ({noise}) must be a token id below "
                          f"vocab_size ({vocab})")
    ids = d["dspark_target_layer_ids"]
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            or not all(0 <= i < n_layers for i in ids)):
        raise ConfigError(f"config.json: field 'dspark_target_layer_ids' must be a non-empty list of layer ids "
                          f"in 0..{n_layers - 1}, found {ids!r}")
    if n_stages == 0:
        raise ConfigError("config.json: DSpark fields are set but 'compress_ratios' has no entries past "
                          f"num_hidden_layers ({n_layers}): no DSpark stages")


def _required_ints(d: dict[str, Any]) -> dict[str, int]:
    """The shape fields every checkpoint has: ints, positive (a model with no hash layers or no shared
    experts may say 0)."""
    mt = d.get("model_type")
    if mt is not None and mt != "deepseek_v4":
        raise ConfigError(f"config.json: field 'model_type' must be 'deepseek_v4', found {mt!r}")
    ints = {k: _get(d, k, int) for k in _REQUIRED_INT}
    for k, v in ints.items():
        if v < 0 or (v == 0 and k not in ("num_hash_layers", "n_shared_experts")):
            raise ConfigError(f"config.json: field '{k}' must be positive, found {v}")
    return ints


def _layer_schedule(d: dict[str, Any], n_layers: int) -> tuple[int, list[int], list[int]]:
    """(MTP layers, main layers' compress ratios, the entries past them): a ratio picks a layer's
    attention kind, so one the model does not know must fail here, not in a kernel."""
    n_mtp = _get(d, "num_nextn_predict_layers", int, 0)
    ratios = d.get("compress_ratios")
    if ratios is None:
        raise ConfigError("config.json: missing required field 'compress_ratios'")
    if not isinstance(ratios, list) or not all(isinstance(r, int) for r in ratios):
        raise ConfigError(f"config.json: field 'compress_ratios' must be a list of ints, found {ratios!r}")
    if len(ratios) < n_layers:
        raise ConfigError(
            f"config.json: field 'compress_ratios' has {len(ratios)} entries but num_hidden_layers is {n_layers}"
        )
    for i, r in enumerate(ratios):
        if r not in RATIO_TO_TYPE and r not in SMALL_HCA_RATIOS:
            raise ConfigError(f"config.json: field 'compress_ratios[{i}]' must be 0, 4 or 128 "
                              f"(or an HCA ratio in {SMALL_HCA_RATIOS} for a small model), found {r}")
    extra = ratios[n_layers:]
    if any(r != 0 for r in extra):
        raise ConfigError(f"config.json: field 'compress_ratios' entries past layer {n_layers} (MTP) must be 0, "
                          f"found {extra}")
    return n_mtp, ratios[:n_layers], extra


def _check_attention(d: dict[str, Any], ints: dict[str, int]) -> None:
    """The attention's head split (RoPE part, indexer, output groups, one shared KV head): the kernels
    and the cache record assume these shapes."""
    head_dim, rope_dim = ints["head_dim"], ints["qk_rope_head_dim"]
    if rope_dim % 2 or rope_dim >= head_dim:
        raise ConfigError(
            f"config.json: field 'qk_rope_head_dim' ({rope_dim}) must be even and < head_dim ({head_dim})"
        )
    if ints["index_head_dim"] <= rope_dim:
        raise ConfigError(
            f"config.json: field 'index_head_dim' ({ints['index_head_dim']}) must exceed qk_rope_head_dim ({rope_dim})"
        )
    if ints["num_attention_heads"] % ints["o_groups"]:
        raise ConfigError(
            f"config.json: field 'o_groups' ({ints['o_groups']}) must divide num_attention_heads "
            f"({ints['num_attention_heads']})"
        )
    if _get(d, "num_key_value_heads", int, 1) != 1:
        raise ConfigError(
            f"config.json: field 'num_key_value_heads' must be 1 (shared-KV MQA), found {d['num_key_value_heads']}"
        )


def _routing(d: dict[str, Any], ints: dict[str, int]) -> dict[str, str]:
    """The MoE's routing (top-k within the experts, hash layers within the layers, the one activation
    and scoring the model implements): its ``scoring_func`` and ``topk_method``."""
    if ints["num_experts_per_tok"] > ints["n_routed_experts"]:
        raise ConfigError(
            f"config.json: field 'num_experts_per_tok' ({ints['num_experts_per_tok']}) exceeds n_routed_experts "
            f"({ints['n_routed_experts']})"
        )
    if ints["num_hash_layers"] > ints["num_hidden_layers"]:
        raise ConfigError(
            f"config.json: field 'num_hash_layers' ({ints['num_hash_layers']}) exceeds num_hidden_layers "
            f"({ints['num_hidden_layers']})"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: field 'hidden_act' must be 'silu', found {act!r}")
    scoring = _get(d, "scoring_func", str, "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"config.json: field 'scoring_func' must be 'sqrtsoftplus', found {scoring!r}")
    return {"scoring_func": scoring, "topk_method": _get(d, "topk_method", str, "noaux_tc")}


def _rope(d: dict[str, Any], rope_dim: int) -> tuple[RopeParams, RopeParams]:
    """(main, compress) RoPE: the main layers' plain ``rope_theta``; the compressed layers'
    ``compress_rope_theta`` with YaRN from ``rope_scaling`` (or ``rope_parameters.compress``)."""
    rope_theta = _get(d, "rope_theta", float, 10000.0)
    compress_theta = _get(d, "compress_rope_theta", float, 160000.0)
    rs = d.get("rope_scaling")
    if rs is None and isinstance(d.get("rope_parameters"), dict):
        rs = d["rope_parameters"].get("compress")
    if rs is None:
        raise ConfigError(
            "config.json: missing required field 'rope_scaling' (YaRN parameters of the compressed layers)"
        )
    if not isinstance(rs, dict):
        raise ConfigError(f"config.json: field 'rope_scaling' must be an object, found {rs!r}")
    rtype = rs.get("type", rs.get("rope_type"))
    if rtype != "yarn":
        raise ConfigError(f"config.json: field 'rope_scaling.type' must be 'yarn', found {rtype!r}")
    for k in ("factor", "original_max_position_embeddings"):
        if k not in rs:
            raise ConfigError(f"config.json: missing required field 'rope_scaling.{k}'")
    for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        v = rs.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"config.json: field 'rope_scaling.{k}' must be a number, found {v!r}")
    rope_main = RopeParams(theta=rope_theta, dim=rope_dim)
    rope_compress = RopeParams(
        theta=compress_theta,
        dim=rope_dim,
        yarn_factor=float(rs["factor"]),
        original_max_position=int(rs["original_max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast", 32)),
        beta_slow=float(rs.get("beta_slow", 1)),
    )
    return rope_main, rope_compress


def _quantization(d: dict[str, Any], ints: dict[str, int]) -> tuple[str, QuantConfig]:
    """(expert dtype, the block-FP8 settings): experts in FP4 (instruct) or FP8 (Base; ``expert_dtype``
    absent or "fp8"), the rest 128×128 block FP8 — the only layouts the readers and kernels decode."""
    if d.get("quantization_config") is not None and not isinstance(d["quantization_config"], dict):
        raise ConfigError(
            f"config.json: field 'quantization_config' must be an object, found {d['quantization_config']!r}"
        )
    expert_dtype = d.get("expert_dtype") or (d.get("quantization_config") or {}).get("expert_dtype") or "fp8"
    if expert_dtype not in ("fp4", "fp8"):
        raise ConfigError(f"config.json: field 'expert_dtype' must be 'fp4' or 'fp8', found {expert_dtype!r}")
    qc = d.get("quantization_config")
    if qc is None:
        raise ConfigError("config.json: missing required field 'quantization_config'")
    if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(
            f"config.json: field 'quantization_config' must be fp8/e4m3, found "
            f"quant_method={qc.get('quant_method')!r} fmt={qc.get('fmt')!r}"
        )
    bs = qc.get("weight_block_size", [128, 128])
    if list(bs) != [128, 128]:
        raise ConfigError(f"config.json: field 'quantization_config.weight_block_size' must be [128, 128], found {bs}")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ConfigError(
            f"config.json: field 'quantization_config.scale_fmt' must be 'ue8m0' or absent, found {scale_fmt!r}"
        )
    if expert_dtype == "fp4" and scale_fmt != "ue8m0":
        raise ConfigError(
            "config.json: field 'quantization_config.scale_fmt' must be 'ue8m0' when expert_dtype is 'fp4'"
        )
    if expert_dtype == "fp4":  # MXFP4 packs 32 input elements per scale: expert inputs must fill whole blocks
        for k in ("hidden_size", "moe_intermediate_size"):
            if ints[k] % 32:
                raise ConfigError(
                    f"config.json: field '{k}' ({ints[k]}) must be a multiple of 32 when expert_dtype is 'fp4'"
                )
    return expert_dtype, QuantConfig(block_size=(128, 128), scale_fmt=scale_fmt,
                                     activation_scheme=qc.get("activation_scheme", "dynamic"))


def _dspark_fields(d: dict[str, Any], n_layers: int, vocab: int, n_stages: int) -> dict[str, Any]:
    """The ``dspark_*`` fields (the 0731 release's drafter), checked when there are any: empty for a
    checkpoint without DSpark stages."""
    dspark = {k: v for k, v in d.items() if k.startswith("dspark_")}
    if dspark:
        _check_dspark(d, n_layers, vocab, n_stages)
    return dspark


def _defaulted_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The fields with a default that need only their type checked (read after the structural checks,
    whose errors say more)."""
    return {
        "routed_scaling_factor": _get(d, "routed_scaling_factor", float, 1.5),
        "norm_topk_prob": _get(d, "norm_topk_prob", bool, True),
        "swiglu_limit": _get(d, "swiglu_limit", float, 10.0),
        "hc_eps": _get(d, "hc_eps", float, 1e-6),
        "rms_norm_eps": _get(d, "rms_norm_eps", float, 1e-6),
        "max_position_embeddings": _get(d, "max_position_embeddings", int, 1048576),
        "bos_token_id": _get(d, "bos_token_id", int, 0),
        "eos_token_id": _get(d, "eos_token_id", int, 1),
        "tie_word_embeddings": _get(d, "tie_word_embeddings", bool, False),
    }


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Validate a config.json dict and build a :class:`ModelConfig`, one concern per helper, in the
    order that decides which of several problems is reported."""
    ints = _required_ints(d)
    n_layers = ints["num_hidden_layers"]
    n_mtp, ratios, extra = _layer_schedule(d, n_layers)
    _check_attention(d, ints)
    routing = _routing(d, ints)
    rope_main, rope_compress = _rope(d, ints["qk_rope_head_dim"])
    expert_dtype, quant = _quantization(d, ints)
    dspark = _dspark_fields(d, n_layers, ints["vocab_size"], len(extra))
    return ModelConfig(
        **ints,
        compress_ratios=tuple(ratios),
        mtp_compress_ratios=tuple(extra),
        num_nextn_predict_layers=n_mtp,
        **routing,
        rope_main=rope_main,
        rope_compress=rope_compress,
        expert_dtype=expert_dtype,
        quant=quant,
        **_defaulted_fields(d),
        dspark=dspark,
        raw=dict(d),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Load ``model_dir/config.json`` (or a path to the json file itself)."""
    p = Path(model_dir)
    path = p if p.suffix == ".json" else p / "config.json"
    if not path.exists():
        raise ConfigError(f"config.json not found at {path}")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    return config_from_dict(d)
