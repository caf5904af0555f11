"""A checkpoint whose FP8-quantized dims are not multiples of 128: partial edge tiles validate, and the
reader + dequantize_block_fp8 reproduce the generator's weights within the FP8 bound."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint
from dsv4.checkpoint.synthetic import _gen, _randn, build_config
from dsv4.config import ConfigError
from dsv4.formats import dequantize_block_fp8

# FP8 linears may have partial 128-blocks; MXFP4 experts need their input dims (hidden, moe_inter)
# to be multiples of 32 (320 = 10·32, 160 = 5·32). vocab and experts shrunk only to keep generation fast.
EDGE = {"hidden_size": 320, "q_lora_rank": 192, "o_lora_rank": 192, "moe_intermediate_size": 160,
        "vocab_size": 512, "n_routed_experts": 4, "num_experts_per_tok": 2}
SEED = 5


@pytest.fixture(scope="module")
def edge_ckpt(tmp_path_factory):
    from dsv4.checkpoint.synthetic import write_checkpoint

    # 2 layers: SWA + CSA (whose indexer.wq_b has K = q_lora_rank = 192), plus the MTP block
    return write_checkpoint(tmp_path_factory.mktemp("edge"), preset="tiny", layers=2, seed=SEED,
                            overrides=EDGE, progress=False)


def test_fp4_experts_need_dims_multiple_of_32():
    with pytest.raises(ConfigError, match="'hidden_size' \\(300\\) must be a multiple of 32"):
        build_config("tiny", overrides={"hidden_size": 300})
    with pytest.raises(ConfigError, match="'moe_intermediate_size' \\(100\\) must be a multiple of 32"):
        build_config("tiny", overrides={"moe_intermediate_size": 100})
    build_config("tiny", expert_dtype="fp8", overrides={"hidden_size": 300})  # FP8 experts: fine


def test_edge_checkpoint_validates(edge_ckpt):
    ck = Checkpoint(edge_ckpt)
    assert ck.problems() == []
    fp8 = {n: s for n, s in ck.specs.items() if s.role == "fp8_weight"}
    partial = {n: s.shape for n, s in fp8.items() if any(d % 128 for d in s.shape)}
    # every FP8 linear of the block touches hidden, q_lora or moe_inter
    assert {"layers.1.attn.wq_a.weight", "layers.1.attn.wq_b.weight", "layers.1.attn.wkv.weight",
            "layers.1.attn.wo_b.weight", "layers.1.attn.indexer.wq_b.weight",
            "layers.1.ffn.shared_experts.w2.weight", "mtp.0.e_proj.weight"} <= set(partial)
    assert partial["layers.1.attn.wq_a.weight"] == (192, 320)
    for n, s in fp8.items():
        scale = ck.specs[n[: -len("weight")] + "scale"]
        assert scale.shape == (math.ceil(s.shape[0] / 128), math.ceil(s.shape[1] / 128)), n
        assert tuple(ck.get(n[: -len("weight")] + "scale").shape) == scale.shape
    w1 = ck.specs["layers.1.ffn.experts.0.w1.weight"]
    assert w1.shape == (160, 160) and ck.specs["layers.1.ffn.experts.0.w1.scale"].shape == (160, 10)
    assert ck.specs["layers.1.ffn.experts.0.w2.scale"].shape == (320, 5)


def _by_hand(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float64 dequantization, one 128×128 tile at a time (edge tiles are simply smaller)."""
    v = q.to(torch.float64)
    b = scale.view(torch.uint8).to(torch.int64)
    out = torch.empty_like(v)
    n, k = v.shape
    for bi in range(math.ceil(n / 128)):
        for bj in range(math.ceil(k / 128)):
            r, c = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            out[r, c] = v[r, c] * 2.0 ** (int(b[bi, bj]) - 127)
    return out


@pytest.mark.parametrize("name", ["layers.1.attn.wq_a.weight",  # [192, 320]: both dims partial
                                  "layers.1.attn.wo_b.weight",  # [320, 384]
                                  "layers.1.ffn.shared_experts.w2.weight",  # [320, 160]
                                  "mtp.0.e_proj.weight"])  # [320, 320]
def test_edge_dequant_reproduces_generator(edge_ckpt, name):
    ck = Checkpoint(edge_ckpt)
    stem = name[: -len(".weight")]
    q, s = ck.get(name), ck.get(f"{stem}.scale")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    n, k = q.shape
    assert n % 128 or k % 128

    deq = dequantize_block_fp8(q, s)
    hand = _by_hand(q, s)
    assert deq.dtype == torch.float32 and deq.shape == (n, k)
    assert torch.equal(deq.double(), hand)  # exact: fp8 × 2^e is representable in fp32

    # the generator's pre-quantization values (its per-tensor RNG stream, first draw)
    w = _randn((n, k), _gen(name, SEED, "cpu"), "cpu", std=1.0 / math.sqrt(k)).double()
    per_elem_scale = hand.new_empty(n, k)
    sb = s.view(torch.uint8).to(torch.int64)
    for bi in range(math.ceil(n / 128)):
        for bj in range(math.ceil(k / 128)):
            r, c = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            sc = 2.0 ** (int(sb[bi, bj]) - 127)
            per_elem_scale[r, c] = sc
            amax = w[r, c].abs().max().item()  # real elements only: edge tiles have fewer
            assert 224 < amax / sc <= 448, (bi, bj)  # the smallest power of two that fits e4m3
    # e4m3 round-to-nearest: ≤ 2^-4 relative for normals, ≤ half the subnormal step (2^-10·scale) below
    bound = torch.maximum(w.abs() * 2.0 ** -4, per_elem_scale * 2.0 ** -10)
    err = (hand - w).abs()
    assert torch.all(err <= bound), (err / bound).max()
    assert err.max() > 0  # it really is quantized
