"""The canary's architecture, trainable weights, quantization-aware views and checkpoint export.

The canary is the DeepSeek-V4 architecture at small widths: SWA (hash-routed MoE), CSA (ratio 4 +
Lightning Indexer top-16), HCA (ratio 32) and CSA layers plus the MTP layer; mHC with 4 streams;
scored MoE with a shared expert; head_dim 512 so the real 584-byte ``fp8_ds_mla`` record is used.
Training runs the *reference model itself* (:class:`dsv4.model.model.ReferenceModel`) on fp32
tensors that require grad (:class:`TensorWeights`), so what is trained is exactly what the engine
runs. Export quantizes with the project's codecs into the release format (FP8 E4M3 128×128 blocks
with UE8M0 scales, MXFP4 experts, BF16 dense tensors), like :mod:`dsv4.checkpoint.synthetic`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..checkpoint.reader import INDEX_FILE
from ..checkpoint.schema import TensorSpec, expected_tensors
from ..checkpoint.synthetic import build_config
from ..config import ModelConfig, config_from_dict
from ..formats import dequantize_block_fp8, dequantize_mxfp4, quantize_block_fp8, quantize_mxfp4
from ..model.weights import ModelWeights
from .tokenizer import VOCAB_SIZE, write_tokenizer

CANARY_OVERRIDES = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "index_n_heads": 4,
    "index_topk": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "num_hash_layers": 1,
    "compress_ratios": [0, 4, 32, 4, 0],
    "max_position_embeddings": 8192,
}
# Init scale of the routed and shared experts' w1/w3 rows (times 1/sqrt(hidden)): pre-activations
# of std ~12 (gate) and ~5 (up) put a real share of them past the SwiGLU limit of 10, so the
# trained canary depends on the clamp and a missing clamp is visible in its accuracy.
GATE_INIT, UP_INIT = 12.0, 5.0


def canary_config_dict(**overrides) -> dict:
    """The canary's config.json: the release config with :data:`CANARY_OVERRIDES` (validated)."""
    return build_config("tiny", overrides={**CANARY_OVERRIDES, **overrides})


class TensorWeights(ModelWeights):
    """:class:`~dsv4.model.weights.ModelWeights` over in-memory tensors (which may require grad).

    No checkpoint behind it: routed experts are looked up by ``prefix + '.weight'`` in their
    logical [out, in] shape, so the reference runs on exactly the tensors being trained.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype=torch.float32, device="cpu"):
        self.ckpt, self.shard = None, None
        self.config, self.t, self.dtype, self.device = config, tensors, dtype, torch.device(device)
        self.cache_experts, self.keep_quantized, self.ops = False, False, {}
        self._stacked, self._experts = {}, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.t[name]

    def get(self, name: str, default=None):
        return self.t.get(name, default)

    def expert(self, prefix: str) -> torch.Tensor:
        return self.t[prefix + ".weight"]


def logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    """[out, in] of a weight whatever its storage (MXFP4 packs two values per byte)."""
    return (spec.shape[0], spec.shape[1] * 2) if spec.role == "fp4_weight" else spec.shape


def trainable_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    return {n: s for n, s in expected_tensors(cfg).items() if s.role not in ("fp8_scale", "fp4_scale")}


def init_params(cfg: ModelConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """fp32 initial values of every tensor (``tid2eid`` as int64: fixed, not trained)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = cfg.num_hidden_layers + cfg.num_mtp_layers
    out: dict[str, torch.Tensor] = {}
    for name, spec in trainable_specs(cfg).items():
        shape = logical_shape(spec)
        leaf = name.rsplit(".", 1)[-1]
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        if spec.role == "index":  # hash routing: distinct experts per token id
            t = torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(dim=1)[:, : shape[1]]
        elif leaf == "weight" and len(shape) == 1:
            t = torch.ones(shape)
        elif name == "embed.weight":
            t = torch.randn(shape, generator=g)
        elif leaf.endswith("_fn"):  # mHC mixes start near their bases
            t = torch.randn(shape, generator=g) * (0.1 / math.sqrt(shape[1]))
        elif leaf.endswith("_base"):
            t = torch.randn(shape, generator=g) * 0.1
            if leaf != "hc_head_base":  # comb starts near the identity: each stream keeps its residual
                n = cfg.hc_mult
                t[2 * n:] += 3.0 * torch.eye(n).flatten()
        elif leaf.endswith("_scale") and leaf.startswith("hc"):
            t = torch.ones(shape)
        elif leaf in ("attn_sink", "ape", "bias"):
            t = torch.zeros(shape)
        elif len(shape) == 2:
            std = 1.0 / math.sqrt(shape[1])
            if stem.endswith((".w1",)) and ".ffn." in stem:
                std *= GATE_INIT
            elif stem.endswith((".w3",)) and ".ffn." in stem:
                std *= UP_INIT
            elif stem.endswith((".w2", ".wo_b")):
                std /= math.sqrt(2 * n_blocks) * (GATE_INIT * UP_INIT / 4 if stem.endswith(".w2") else 1.0)
            elif name == "head.weight":
                std *= 0.5
            t = torch.randn(shape, generator=g) * std
        else:
            raise ValueError(f"no canary init rule for tensor {name} {shape}")
        out[name] = t.to(device)
    return out


def load_params(model_dir: str | Path, device="cpu") -> dict[str, torch.Tensor]:
    """fp32 values of a written canary checkpoint (what it stores), to resume training from."""
    from ..checkpoint.reader import Checkpoint

    ckpt = Checkpoint(model_dir)
    out = {}
    for name, spec in trainable_specs(ckpt.config).items():
        raw = ckpt.get(name)
        stem = name[: -len(".weight")]
        if spec.role == "fp8_weight":
            t = dequantize_block_fp8(raw, ckpt.get(stem + ".scale"), out_dtype=torch.float32)
        elif spec.role == "fp4_weight":
            t = dequantize_mxfp4(raw, ckpt.get(stem + ".scale"), dtype=torch.float32)
        elif spec.role == "index":
            t = raw.long()
        else:
            t = raw.float()
        out[name] = t.to(device)
    return out


# ---- quantization ----------------------------------------------------------------------------
def fq_fp8(w: torch.Tensor) -> torch.Tensor:
    """What the checkpoint's FP8 E4M3 128×128 block (UE8M0 scale) stores for ``w``."""
    q, s = quantize_block_fp8(w.detach().float(), block=128, scale_fmt="ue8m0")
    return dequantize_block_fp8(q, s, out_dtype=torch.float32)


def fq_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """What the checkpoint's MXFP4 (E2M1, UE8M0 per 32) stores for ``w``."""
    q, s = quantize_mxfp4(w.detach().float())
    return dequantize_mxfp4(q, s, dtype=torch.float32)


def stored_value(spec: TensorSpec, w: torch.Tensor, expert_dtype: str = "fp4") -> torch.Tensor:
    """The value of a tensor after the round trip through its checkpoint dtype (no gradient)."""
    if spec.role == "fp8_weight":
        return fq_fp8(w)
    if spec.role == "fp4_weight":
        return fq_mxfp4(w)
    if spec.role == "index":
        return w
    if spec.dtype == "BF16":
        return w.detach().to(torch.bfloat16).float()
    return w.detach().float()


def forward_tensors(params: dict[str, torch.Tensor], cfg: ModelConfig, quantized: bool) -> dict[str, torch.Tensor]:
    """The tensors a forward uses: the params, or (``quantized``) their stored values with a
    straight-through gradient (quantization-aware training).

    Same-shaped FP8 / MXFP4 weights are quantized as one stacked tensor (the codecs work on any
    leading dims, per 128×128 block or per 32 values): a few hundred ops instead of thousands.
    """
    if not quantized:
        return dict(params)
    specs = trainable_specs(cfg)
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}
    for name, w in params.items():
        spec = specs[name]
        if spec.role in ("fp8_weight", "fp4_weight"):
            groups.setdefault((spec.role, tuple(w.shape)), []).append(name)
        elif spec.role == "index" or not w.is_floating_point():
            out[name] = w
        else:
            out[name] = w + (stored_value(spec, w) - w).detach()
    for (role, _), names in groups.items():
        stack = torch.stack([params[n] for n in names])
        fq = fq_fp8(stack) if role == "fp8_weight" else fq_mxfp4(stack)
        for n, t in zip(names, (stack + (fq - stack).detach()).unbind(0)):
            out[n] = t
    return out


# ---- export ----------------------------------------------------------------------------------
def checkpoint_tensors(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Release-format tensors: FP8 + UE8M0 block scales, MXFP4 experts, BF16/F32 as the schema says."""
    specs = expected_tensors(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.role in ("fp8_scale", "fp4_scale"):
            continue
        w = params[name].detach().float().cpu()
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        if spec.role == "fp4_weight":
            packed, scale = quantize_mxfp4(w)
            out[name], out[f"{stem}.scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
        elif spec.role == "fp8_weight":
            out[name], out[f"{stem}.scale"] = quantize_block_fp8(w, block=128, scale_fmt="ue8m0")
        elif spec.role == "index":
            out[name] = params[name].detach().cpu().to(torch.int64 if spec.dtype == "I64" else torch.int32)
        else:
            out[name] = w.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32)
    return out


def write_checkpoint(params: dict[str, torch.Tensor], cfg_dict: dict, out_dir: str | Path,
                     extra: dict | None = None) -> Path:
    """Write a loadable model directory: config.json, one safetensors shard + index, tokenizer,
    generation_config.json (greedy by default), and ``canary.json`` from ``extra``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_dict(cfg_dict)
    tensors = checkpoint_tensors(params, cfg)
    fname = "model-00001-of-00001.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / fname), metadata={"format": "pt"})
    size = (out / fname).stat().st_size
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": {k: fname for k in tensors}}, indent=2) + "\n"
    )
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "temperature": 0.0}, indent=2)
        + "\n"
    )
    write_tokenizer(out, cfg.max_position_embeddings)
    if extra is not None:
        (out / "canary.json").write_text(json.dumps(extra, indent=2) + "\n")
    return out
