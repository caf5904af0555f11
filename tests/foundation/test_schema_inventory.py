"""dsv4.checkpoint.schema: the release tensor inventory the real Flash config implies."""

from __future__ import annotations

from collections import Counter

import pytest
from foundation_helpers import flash_0423_dict

from dsv4.checkpoint.schema import expected_tensors, layer_of, optional_tensors
from dsv4.config import config_from_dict


@pytest.fixture(scope="module")
def flash_specs():
    """Built once per module: the full inventory is 69,187 entries."""
    return expected_tensors(config_from_dict(flash_0423_dict()))


def test_published_counts(flash_specs):
    assert len(flash_specs) == 69187  # tensors in the published model.safetensors.index.json
    assert sum(n.startswith("mtp.0.") for n in flash_specs) == 1575
    assert not any(n.startswith("mtp.1.") for n in flash_specs)


def test_file_order_and_grouping(flash_specs):
    names = list(flash_specs)
    assert names[0] == "embed.weight"
    assert names[-1] == "mtp.0.norm.weight"
    groups = Counter(layer_of(n) for n in names)
    assert set(groups) == {"globals", "mtp.0"} | {f"layers.{i}" for i in range(43)}
    # globals: embed, norm, head, hc_head_{fn,base,scale}
    assert groups["globals"] == 6
    # per layer: 23 attn/hc/norm/gate tensors + shared expert + 256 experts × 3 linears × (weight, scale)
    experts = 256 * 3 * 2
    shared = 3 * 2
    swa = 2 + 6 + 12 + 1 + 2  # norms, hc_*, 5 fp8 linears × 2 + q_norm + kv_norm, sink, gate.weight + bias|tid2eid
    assert groups["layers.0"] == swa + shared + experts
    assert groups["layers.3"] == swa + 4 + shared + experts  # + HCA compressor (wkv, wgate, ape, norm)
    assert groups["layers.2"] == swa + 4 + 2 + 1 + 4 + shared + experts  # + CSA compressor and indexer
    assert groups["mtp.0"] == swa + shared + experts + 2 + 4 + 3 + 1  # enorm/hnorm, e/h_proj, hc_head, norm


# (name, dtype the release writes, shape) — from the facts tables of the real shard headers
SPOT = [
    ("embed.weight", "BF16", (129280, 4096)),
    ("head.weight", "BF16", (129280, 4096)),
    ("norm.weight", "BF16", (4096,)),
    ("hc_head_fn", "F32", (4, 16384)),
    ("hc_head_base", "F32", (4,)),
    ("hc_head_scale", "F32", (1,)),
    ("layers.2.attn_norm.weight", "BF16", (4096,)),
    ("layers.2.attn.q_norm.weight", "BF16", (1024,)),
    ("layers.2.attn.kv_norm.weight", "BF16", (512,)),
    ("layers.2.attn.attn_sink", "F32", (64,)),
    ("layers.2.attn.wq_a.weight", "F8_E4M3", (1024, 4096)),
    ("layers.2.attn.wq_a.scale", "F8_E8M0", (8, 32)),
    ("layers.2.attn.wq_b.weight", "F8_E4M3", (32768, 1024)),
    ("layers.2.attn.wq_b.scale", "F8_E8M0", (256, 8)),
    ("layers.2.attn.wkv.weight", "F8_E4M3", (512, 4096)),
    ("layers.2.attn.wkv.scale", "F8_E8M0", (4, 32)),
    ("layers.2.attn.wo_a.weight", "F8_E4M3", (8192, 4096)),
    ("layers.2.attn.wo_a.scale", "F8_E8M0", (64, 32)),
    ("layers.2.attn.wo_b.weight", "F8_E4M3", (4096, 8192)),
    ("layers.2.attn.wo_b.scale", "F8_E8M0", (32, 64)),
    ("layers.2.attn.compressor.wkv.weight", "BF16", (1024, 4096)),
    ("layers.2.attn.compressor.wgate.weight", "BF16", (1024, 4096)),
    ("layers.2.attn.compressor.ape", "F32", (4, 1024)),
    ("layers.2.attn.compressor.norm.weight", "BF16", (512,)),
    ("layers.3.attn.compressor.wkv.weight", "BF16", (512, 4096)),
    ("layers.3.attn.compressor.ape", "F32", (128, 512)),
    ("layers.2.attn.indexer.wq_b.weight", "F8_E4M3", (8192, 1024)),
    ("layers.2.attn.indexer.wq_b.scale", "F8_E8M0", (64, 8)),
    ("layers.2.attn.indexer.weights_proj.weight", "BF16", (64, 4096)),
    ("layers.2.attn.indexer.compressor.wkv.weight", "BF16", (256, 4096)),
    ("layers.2.attn.indexer.compressor.wgate.weight", "BF16", (256, 4096)),
    ("layers.2.attn.indexer.compressor.ape", "F32", (4, 256)),
    ("layers.2.attn.indexer.compressor.norm.weight", "BF16", (128,)),
    ("layers.2.hc_attn_fn", "F32", (24, 16384)),
    ("layers.2.hc_ffn_base", "F32", (24,)),
    ("layers.2.hc_attn_scale", "F32", (3,)),
    ("layers.0.ffn.gate.weight", "BF16", (256, 4096)),
    ("layers.0.ffn.gate.tid2eid", "I64", (129280, 6)),
    ("layers.2.ffn.gate.tid2eid", "I64", (129280, 6)),
    ("layers.3.ffn.gate.bias", "F32", (256,)),
    ("layers.5.ffn.shared_experts.w1.weight", "F8_E4M3", (2048, 4096)),
    ("layers.5.ffn.shared_experts.w1.scale", "F8_E8M0", (16, 32)),
    ("layers.5.ffn.shared_experts.w2.weight", "F8_E4M3", (4096, 2048)),
    ("layers.5.ffn.shared_experts.w2.scale", "F8_E8M0", (32, 16)),
    ("layers.5.ffn.experts.7.w1.weight", "I8", (2048, 2048)),
    ("layers.5.ffn.experts.7.w1.scale", "F8_E8M0", (2048, 128)),
    ("layers.5.ffn.experts.7.w3.weight", "I8", (2048, 2048)),
    ("layers.5.ffn.experts.7.w2.weight", "I8", (4096, 1024)),
    ("layers.5.ffn.experts.7.w2.scale", "F8_E8M0", (4096, 64)),
    ("layers.42.ffn.experts.255.w2.scale", "F8_E8M0", (4096, 64)),
    ("mtp.0.enorm.weight", "BF16", (4096,)),
    ("mtp.0.hnorm.weight", "BF16", (4096,)),
    ("mtp.0.e_proj.weight", "F8_E4M3", (4096, 4096)),
    ("mtp.0.h_proj.scale", "F8_E8M0", (32, 32)),
    ("mtp.0.hc_head_fn", "F32", (4, 16384)),
    ("mtp.0.attn.wq_a.weight", "F8_E4M3", (1024, 4096)),
    ("mtp.0.ffn.gate.bias", "F32", (256,)),
    ("mtp.0.ffn.experts.255.w1.weight", "I8", (2048, 2048)),
]


@pytest.mark.parametrize("name,dtype,shape", SPOT, ids=[s[0] for s in SPOT])
def test_spot_shapes_and_dtypes(flash_specs, name, dtype, shape):
    spec = flash_specs[name]
    assert spec.dtype == dtype
    assert spec.shape == shape


@pytest.mark.parametrize("name", [
    "layers.0.attn.compressor.ape",  # SWA layers have no compressor
    "layers.3.attn.indexer.wq_b.weight",  # HCA layers have no indexer
    "layers.2.attn.indexer.wk.weight",  # DSv4's indexer has no wk / k_norm (unlike V3.2)
    "layers.0.ffn.gate.bias",  # hash layers route by tid2eid
    "layers.3.ffn.gate.tid2eid",
    "layers.2.attn.compressor.wkv.scale",  # compressors are unquantized
    "mtp.0.attn.compressor.wkv.weight",  # the MTP block is SWA only
    "mtp.0.ffn.gate.tid2eid",  # … and never hash-routed
    "mtp.0.embed.weight",  # it shares the target's embedding and head
    "mtp.0.head.weight",
    "layers.0.ffn.experts.256.w1.weight",
])
def test_absent_keys(flash_specs, name):
    assert name not in flash_specs


def test_accepted_alternative_dtypes(flash_specs):
    assert flash_specs["layers.2.attn_norm.weight"].dtypes == ("BF16", "F32")
    assert flash_specs["layers.2.attn.compressor.wkv.weight"].dtypes == ("BF16", "F32")
    assert flash_specs["layers.0.ffn.gate.tid2eid"].dtypes == ("I64", "I32")
    assert flash_specs["layers.2.attn.wq_a.weight"].dtypes == ("F8_E4M3",)


def test_roles(flash_specs):
    roles = Counter(s.role for s in flash_specs.values())
    n_blocks = 44  # 43 layers + MTP
    assert roles["fp4_weight"] == roles["fp4_scale"] == n_blocks * 256 * 3
    # per block: wq_a, wq_b, wkv, wo_a, wo_b + 3 shared; + 21 indexer.wq_b; + MTP e_proj, h_proj
    assert roles["fp8_weight"] == roles["fp8_scale"] == n_blocks * 8 + 21 + 2
    assert roles["index"] == 3


def test_base_variant_inventory(base_dict):
    specs = expected_tensors(config_from_dict(base_dict))
    assert len(specs) == 69187
    w2 = specs["layers.5.ffn.experts.7.w2.weight"]
    s2 = specs["layers.5.ffn.experts.7.w2.scale"]
    assert (w2.dtype, w2.shape, w2.role) == ("F8_E4M3", (4096, 2048), "fp8_weight")
    assert (s2.dtype, s2.shape, s2.role) == ("F32", (32, 16), "fp8_scale")
    w1 = specs["layers.0.ffn.experts.0.w1.weight"]
    assert (w1.dtype, w1.shape) == ("F8_E4M3", (2048, 4096))
    assert specs["layers.0.ffn.experts.0.w1.scale"].shape == (16, 32)
    # every block scale (not just the experts') is float32 in the Base format
    assert {s.dtype for s in specs.values() if s.role == "fp8_scale"} == {"F32"}
    assert not any(s.role.startswith("fp4") for s in specs.values())


def test_dspark_inventory(flash_0731_dict):
    """0731: three full DSpark stages under mtp.0-2 in place of the MTP block (1575 tensors: a block's
    1565 and its 10 MTP extras), the context projection on stage 0, the heads on stage 2; the
    confidence head is optional."""
    cfg = config_from_dict(flash_0731_dict)
    specs = expected_tensors(cfg)
    assert len(specs) == 69187 - 1575 + 3 * 1565 + 3 + 6  # + main_proj (2), main_norm; norm, hc_head (3), markov (2)
    for m in range(3):
        assert specs[f"mtp.{m}.ffn.shared_experts.w1.weight"].shape == (2048, 4096)
        assert specs[f"mtp.{m}.attn.wkv.weight"].shape == (512, 4096)
        assert f"mtp.{m}.ffn.gate.bias" in specs and f"mtp.{m}.ffn.gate.tid2eid" not in specs  # never hash-routed
        assert f"mtp.{m}.e_proj.weight" not in specs and f"mtp.{m}.enorm.weight" not in specs
    mp, ms = specs["mtp.0.main_proj.weight"], specs["mtp.0.main_proj.scale"]
    assert (mp.dtype, mp.shape, ms.dtype, ms.shape) == ("F8_E4M3", (4096, 3 * 4096), "F8_E8M0", (32, 96))
    assert specs["mtp.0.main_norm.weight"].shape == (4096,)
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        s = specs[f"mtp.2.{name}"]
        assert (s.dtype, s.shape) == ("BF16", (129280, 256))
    assert specs["mtp.2.hc_head_fn"].shape == (4, 4 * 4096) and "mtp.2.norm.weight" in specs
    assert "mtp.0.norm.weight" not in specs and "mtp.1.hc_head_fn" not in specs
    opt = optional_tensors(cfg)
    assert {n: s.shape for n, s in opt.items()} == {"mtp.2.confidence_head.proj.weight": (1, 4096 + 256),
                                                     "mtp.2.confidence_head.proj.bias": (1,)}


def test_no_optional_tensors_for_classic_mtp(flash_dict):
    assert optional_tensors(config_from_dict(flash_dict)) == {}


def test_layer_of():
    assert layer_of("layers.3.attn.wq_a.weight") == "layers.3"
    assert layer_of("mtp.0.e_proj.weight") == "mtp.0"
    assert layer_of("hc_head_fn") == "globals"
    assert layer_of("embed.weight") == "globals"
