"""dsv4.config: the real configs load, the layer schedule and both RoPE variants are right, and every
validation error names the offending field."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from foundation_helpers import DSPARK_FIELDS, FLASH_0423, FLASH_0731

from dsv4.config import ConfigError, LayerType, config_from_dict, load_config

# ---- the real configs ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", [FLASH_0423, FLASH_0731], ids=["0423", "0731"])
def test_real_config_files_load(path):
    if not path.exists():
        pytest.skip(f"{path} not available")
    cfg = load_config(path)  # a path to the json file itself
    assert cfg.hidden_size == 4096 and cfg.num_hidden_layers == 43 and cfg.vocab_size == 129280
    assert cfg.expert_dtype == "fp4" and cfg.quant.scale_fmt == "ue8m0"
    assert cfg.quant.block_size == (128, 128)
    # load_config also takes the directory holding config.json
    assert load_config(path.parent / path.name).compress_ratios == cfg.compress_ratios


def test_generator_reference_config_is_the_real_0423_config():
    """synthetic.REFERENCE_CONFIG transcribes the published config.json: keep them identical."""
    if not FLASH_0423.exists():
        pytest.skip(f"{FLASH_0423} not available")
    from dsv4.checkpoint.synthetic import REFERENCE_CONFIG

    assert REFERENCE_CONFIG == json.loads(FLASH_0423.read_text())


def test_load_config_from_directory(tmp_path, flash_dict):
    (tmp_path / "config.json").write_text(json.dumps(flash_dict))
    cfg = load_config(tmp_path)
    assert cfg.num_attention_heads == 64
    assert cfg.to_dict() == flash_dict


def test_flash_scalar_fields(flash_dict):
    c = config_from_dict(flash_dict)
    assert (c.head_dim, c.qk_rope_head_dim, c.nope_head_dim) == (512, 64, 448)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.heads_per_group) == (1024, 8, 1024, 8)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window) == (64, 128, 512, 128)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 1, 6, 2048)
    assert (c.hc_mult, c.hc_dim, c.hc_mix_dim, c.hc_sinkhorn_iters) == (4, 16384, 24, 20)
    assert c.routed_scaling_factor == 1.5 and c.swiglu_limit == 10.0 and c.norm_topk_prob is True
    assert c.scoring_func == "sqrtsoftplus" and c.topk_method == "noaux_tc"
    assert c.max_position_embeddings == 1048576 and (c.bos_token_id, c.eos_token_id) == (0, 1)
    assert c.tie_word_embeddings is False


# ---- layer schedule ------------------------------------------------------------------------------

def _check_main_schedule(c):
    types = c.layer_types
    assert len(types) == 43 == len(c.compress_ratios)
    assert types.count(LayerType.SWA) == 2
    assert types.count(LayerType.CSA) == 21
    assert types.count(LayerType.HCA) == 20
    assert types[0] == types[1] == LayerType.SWA
    assert all(types[i] == LayerType.CSA for i in range(2, 43, 2))
    assert all(types[i] == LayerType.HCA for i in range(3, 42, 2))
    assert types[42] == LayerType.CSA
    assert [c.compress_ratio(i) for i in (0, 1, 2, 3, 42)] == [0, 0, 4, 128, 4]
    assert [i for i in range(43) if c.is_hash_layer(i)] == [0, 1, 2]


def test_flash_0423_schedule_and_mtp(flash_dict):
    c = config_from_dict(flash_dict)
    _check_main_schedule(c)
    assert len(flash_dict["compress_ratios"]) == 44
    assert c.mtp_compress_ratios == (0,)
    assert not c.is_dspark and c.dspark == {}
    assert c.num_nextn_predict_layers == 1 and c.num_mtp_layers == 1
    mtp = c.num_hidden_layers  # layer index 43 = the MTP block
    assert c.layer_type(mtp) == LayerType.SWA
    assert c.compress_ratio(mtp) == 0
    assert not c.is_hash_layer(mtp)
    assert c.rope(mtp) == c.rope_main
    summary = c.schedule_summary()
    assert summary.startswith("0:SWA+hash 1:SWA+hash 2:CSA+hash 3:HCA 4:CSA")
    assert summary.endswith("42:CSA mtp×1:SWA")


def test_flash_0731_dspark(flash_0731_dict):
    d = flash_0731_dict
    assert len(d["compress_ratios"]) == 46 and d["compress_ratios"][-3:] == [0, 0, 0]
    c = config_from_dict(d)
    _check_main_schedule(c)
    assert c.mtp_compress_ratios == (0, 0, 0)
    assert c.is_dspark
    assert c.dspark == DSPARK_FIELDS
    assert c.num_nextn_predict_layers == 1
    assert c.num_mtp_layers == 0  # the mtp namespace holds DSpark stages, not a classic MTP block
    assert "dspark×3" in c.schedule_summary() and "mtp×" not in c.schedule_summary()


def test_rope_choice_per_layer(flash_dict):
    c = config_from_dict(flash_dict)
    assert c.rope(0) is c.rope_main and c.rope(1) is c.rope_main
    assert c.rope(2) is c.rope_compress and c.rope(3) is c.rope_compress


# ---- RoPE ----------------------------------------------------------------------------------------

def _plain(theta: float, dim: int = 64) -> torch.Tensor:
    return torch.tensor([1.0 / theta ** (2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def test_rope_main_is_plain(flash_dict):
    r = config_from_dict(flash_dict).rope_main
    assert (r.theta, r.dim, r.yarn_factor) == (10000.0, 64, 1.0)
    inv = r.inv_freq()
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    assert torch.equal(inv, _plain(10000.0).float())


def test_rope_compress_yarn(flash_dict):
    r = config_from_dict(flash_dict).rope_compress
    assert (r.theta, r.dim, r.yarn_factor, r.original_max_position) == (160000.0, 64, 16.0, 65536)
    assert (r.beta_fast, r.beta_slow) == (32.0, 1.0)

    # correction range by hand: dim(rot) = d·ln(L/(2π·rot)) / (2·ln θ)
    def dim_for(rot):
        return 64 * math.log(65536 / (2 * math.pi * rot)) / (2 * math.log(160000))

    assert 15 < dim_for(32) < 16 and 24 < dim_for(1) < 25
    assert r.yarn_correction_range() == (15, 25)

    base = _plain(160000.0)
    inv = r.inv_freq()
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    assert torch.equal(inv[:16], base[:16].float())  # pairs 0..15: extrapolated (original)
    assert torch.equal(inv[25:] * 16, base[25:].float())  # pairs 25..31: exactly freq / 16
    assert torch.equal(inv[25:], (base[25:] / 16).float())
    # pair 20 sits half way up the ramp (20 − 15) / (25 − 15) = 0.5
    assert inv[20].item() == pytest.approx((0.5 * base[20] + 0.5 * base[20] / 16).item(), rel=1e-7)
    # the ramp in between is linear in the pair index
    for i in range(16, 25):
        w = (i - 15) / 10
        assert inv[i].item() == pytest.approx(((1 - w) * base[i] + w * base[i] / 16).item(), rel=1e-7)
    assert torch.all(inv[1:] < inv[:-1])  # still monotone


def test_rope_parameters_nested_form(flash_dict):
    """transformers-style configs carry the YaRN block under rope_parameters.compress."""
    d = copy.deepcopy(flash_dict)
    rs = d.pop("rope_scaling")
    d["rope_parameters"] = {"main": {"rope_type": "default"}, "compress": {**rs, "rope_type": rs["type"]}}
    del d["rope_parameters"]["compress"]["type"]
    assert config_from_dict(d).rope_compress == config_from_dict(flash_dict).rope_compress


# ---- Base variant (FP8 experts, float32 scales) --------------------------------------------------

def test_base_variant_expert_dtype_absent(base_dict):
    c = config_from_dict(base_dict)
    assert c.expert_dtype == "fp8"
    assert c.quant.scale_fmt is None  # → float32 block scales


def test_base_variant_expert_dtype_fp8(base_dict):
    base_dict["expert_dtype"] = "fp8"
    c = config_from_dict(base_dict)
    assert c.expert_dtype == "fp8" and c.quant.scale_fmt is None


def test_expert_dtype_in_quantization_config(base_dict):
    base_dict["quantization_config"]["expert_dtype"] = "fp4"
    base_dict["quantization_config"]["scale_fmt"] = "ue8m0"
    assert config_from_dict(base_dict).expert_dtype == "fp4"


def test_integral_floats_accepted(flash_dict):
    flash_dict["hidden_size"] = 4096.0
    c = config_from_dict(flash_dict)
    assert c.hidden_size == 4096 and isinstance(c.hidden_size, int)


def test_fp8_experts_allow_dims_not_multiple_of_32(base_dict):
    base_dict["hidden_size"] = 4100  # block-FP8 handles partial edge tiles; only MXFP4 needs /32
    assert config_from_dict(base_dict).hidden_size == 4100


# ---- validation errors: each names its field ----------------------------------------------------

def _set(key, value):
    def f(d):
        d[key] = value
    return f


def _del(key):
    def f(d):
        del d[key]
    return f


def _ratio(i, v):
    def f(d):
        d["compress_ratios"][i] = v
    return f


def _rs(key, value):
    def f(d):
        d["rope_scaling"][key] = value
    return f


def _qc(key, value=None, delete=False):
    def f(d):
        if delete:
            del d["quantization_config"][key]
        else:
            d["quantization_config"][key] = value
    return f


BAD = [
    # id, mutation, quoted field the message must name, further fragments it must show
    ("missing-hidden_size", _del("hidden_size"), "'hidden_size'", ["missing"]),
    ("missing-vocab_size", _del("vocab_size"), "'vocab_size'", ["missing"]),
    ("str-hidden_size", _set("hidden_size", "4096"), "'hidden_size'", ["must be int", "'4096'"]),
    ("bool-num_attention_heads", _set("num_attention_heads", True), "'num_attention_heads'", ["must be int", "True"]),
    ("fractional-head_dim", _set("head_dim", 512.5), "'head_dim'", ["must be int", "512.5"]),
    ("str-routed_scaling_factor", _set("routed_scaling_factor", "1.5"), "'routed_scaling_factor'", ["must be float"]),
    ("str-norm_topk_prob", _set("norm_topk_prob", "true"), "'norm_topk_prob'", ["must be bool"]),
    ("zero-hidden_size", _set("hidden_size", 0), "'hidden_size'", ["positive", "0"]),
    ("negative-n_shared_experts", _set("n_shared_experts", -1), "'n_shared_experts'", ["-1"]),
    ("wrong-model_type", _set("model_type", "deepseek_v3"), "'model_type'", ["'deepseek_v3'"]),
    ("missing-compress_ratios", _del("compress_ratios"), "'compress_ratios'", ["missing"]),
    ("compress_ratios-not-list", _set("compress_ratios", "0,0,4"), "'compress_ratios'", ["list of ints"]),
    ("compress_ratios-too-short", lambda d: d.update(compress_ratios=d["compress_ratios"][:40]),
     "'compress_ratios'", ["40 entries", "43"]),
    ("ratio-3", _ratio(5, 3), "'compress_ratios[5]'", ["0, 4 or 128", "found 3"]),
    ("nonzero-mtp-ratio", _ratio(43, 4), "'compress_ratios'", ["MTP", "must be 0", "[4]"]),
    ("o_groups-not-dividing", _set("o_groups", 7), "'o_groups'", ["(7)", "divide", "(64)"]),
    ("num_key_value_heads-2", _set("num_key_value_heads", 2), "'num_key_value_heads'", ["must be 1", "found 2"]),
    ("hidden_act-gelu", _set("hidden_act", "gelu"), "'hidden_act'", ["'silu'", "'gelu'"]),
    ("scoring_func-softmax", _set("scoring_func", "softmax"), "'scoring_func'", ["'sqrtsoftplus'", "'softmax'"]),
    ("experts_per_tok-too-many", _set("num_experts_per_tok", 300), "'num_experts_per_tok'", ["300", "256"]),
    ("hash-layers-too-many", _set("num_hash_layers", 44), "'num_hash_layers'", ["44", "43"]),
    ("odd-rope-dim", _set("qk_rope_head_dim", 63), "'qk_rope_head_dim'", ["63", "even"]),
    ("index_head_dim-too-small", _set("index_head_dim", 64), "'index_head_dim'", ["64"]),
    ("missing-rope_scaling", _del("rope_scaling"), "'rope_scaling'", ["missing"]),
    ("rope_scaling-not-object", _set("rope_scaling", "yarn"), "'rope_scaling'", ["'yarn'"]),
    ("rope_scaling-linear", _rs("type", "linear"), "'rope_scaling.type'", ["'yarn'", "'linear'"]),
    ("rope_scaling-no-factor", lambda d: d["rope_scaling"].pop("factor"), "'rope_scaling.factor'", ["missing"]),
    ("rope_scaling-str-factor", _rs("factor", "16"), "'rope_scaling.factor'", ["'16'"]),
    ("expert_dtype-fp16", _set("expert_dtype", "fp16"), "'expert_dtype'", ["'fp4' or 'fp8'", "'fp16'"]),
    ("fp4-without-ue8m0", _qc("scale_fmt", delete=True), "'quantization_config.scale_fmt'", ["'ue8m0'", "fp4"]),
    ("scale_fmt-other", _qc("scale_fmt", "e4m3"), "'quantization_config.scale_fmt'", ["'e4m3'"]),
    ("block-64", _qc("weight_block_size", [64, 64]), "'quantization_config.weight_block_size'", ["[64, 64]"]),
    ("quant_method-int8", _qc("quant_method", "int8"), "'quantization_config'", ["'int8'"]),
    ("missing-quantization_config", _del("quantization_config"), "'quantization_config'", ["missing"]),
    ("quantization_config-not-object", _set("quantization_config", ["fp8"]), "'quantization_config'", ["['fp8']"]),
    ("fp4-hidden-not-32", _set("hidden_size", 4100), "'hidden_size'", ["4100", "32", "fp4"]),
    ("fp4-inter-not-32", _set("moe_intermediate_size", 2000), "'moe_intermediate_size'", ["2000", "32", "fp4"]),
]


@pytest.mark.parametrize("mutate,field,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_error_names_field(flash_dict, mutate, field, fragments):
    mutate(flash_dict)
    with pytest.raises(ConfigError) as ei:
        config_from_dict(flash_dict)
    msg = str(ei.value)
    assert msg.startswith("config.json:"), msg
    assert field in msg, msg
    for frag in fragments:
        assert frag in msg, msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)  # the CLI reports ValueErrors without a traceback


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 4096,')
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    msg = str(ei.value)
    assert str(tmp_path / "config.json") in msg and "not valid JSON" in msg


def test_json_top_level_not_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_config(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    assert f"config.json not found at {tmp_path / 'config.json'}" in str(ei.value)
