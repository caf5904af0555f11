"""An independent implementation reads our synthetic checkpoints: transformers 5.23's
DeepseekV4ForCausalLM loads the release-named FP8/FP4 files with its own dequantizing loader, with no
missing, unexpected or mismatched keys, and its dequantized weights equal our codecs' bit for bit."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dsv4.checkpoint.reader import Checkpoint  # noqa: E402
from dsv4.formats import dequantize_block_fp8, dequantize_mxfp4  # noqa: E402

# release name → transformers parameter (found by listing model.named_parameters())
FP8_LINEARS = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
CSA_LAYER = 1  # tiny: 0 SWA, 1 CSA, 2 HCA, 3 CSA


def _load(path):
    from transformers import DeepseekV4ForCausalLM

    # dtype is required: dtype inference on the F8_E8M0 header fails ("unknown dtype F8_E8M0")
    model, info = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    model.eval()
    return model, info


@pytest.fixture(scope="module")
def hf_fp4(tiny_ckpt):
    return _load(tiny_ckpt)


@pytest.fixture(scope="module")
def hf_fp8(tiny_ckpt_fp8_experts):
    return _load(tiny_ckpt_fp8_experts)


def _assert_clean(info):
    assert not info["missing_keys"], sorted(info["missing_keys"])[:10]
    assert not info["unexpected_keys"], sorted(info["unexpected_keys"])[:10]
    assert not info["mismatched_keys"], list(info["mismatched_keys"])[:10]
    assert not info.get("error_msgs")


def _forward_is_finite(model, vocab):
    ids = torch.tensor([[0, 5, 17, 300, 9, 128000, 42]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], vocab)
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0
    return logits


def test_fp4_checkpoint_loads_cleanly(hf_fp4, tiny_ckpt):
    model, info = hf_fp4
    _assert_clean(info)
    cfg = Checkpoint(tiny_ckpt).config
    assert model.config.num_hidden_layers == cfg.num_hidden_layers
    _forward_is_finite(model, cfg.vocab_size)


def test_fp4_dequantized_weights_match_our_codecs(hf_fp4, tiny_ckpt):
    model, _ = hf_fp4
    ck = Checkpoint(tiny_ckpt)
    c = ck.config
    params = dict(model.named_parameters())
    for layer in (0, CSA_LAYER):
        for ours, theirs in FP8_LINEARS.items():
            p = f"layers.{layer}.{ours}"
            want = dequantize_block_fp8(ck.get(f"{p}.weight"), ck.get(f"{p}.scale")).to(torch.bfloat16)
            got = params[f"model.layers.{layer}.{theirs}.weight"]
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), p
    p = f"layers.{CSA_LAYER}.attn.indexer.wq_b"
    want = dequantize_block_fp8(ck.get(f"{p}.weight"), ck.get(f"{p}.scale")).to(torch.bfloat16)
    assert torch.equal(params[f"model.layers.{CSA_LAYER}.self_attn.compressor.indexer.q_b_proj.weight"], want)

    # routed experts: transformers fuses w1‖w3 into gate_up_proj [E, 2·inter, hidden]
    inter = c.moe_intermediate_size
    gate_up = params["model.layers.2.mlp.experts.gate_up_proj"]
    down = params["model.layers.2.mlp.experts.down_proj"]
    assert gate_up.shape == (c.n_routed_experts, 2 * inter, c.hidden_size)
    assert down.shape == (c.n_routed_experts, c.hidden_size, inter)
    for e in (0, 5, c.n_routed_experts - 1):
        def fp4(w):
            stem = f"layers.2.ffn.experts.{e}.{w}"
            return dequantize_mxfp4(ck.get(f"{stem}.weight"), ck.get(f"{stem}.scale")).to(torch.bfloat16)

        assert torch.equal(gate_up[e, :inter], fp4("w1")), e  # gate
        assert torch.equal(gate_up[e, inter:], fp4("w3")), e  # up
        assert torch.equal(down[e], fp4("w2")), e


def test_unquantized_tensors_and_rope_agree(hf_fp4, tiny_ckpt):
    model, _ = hf_fp4
    ck = Checkpoint(tiny_ckpt)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for theirs, ours in [("model.layers.1.self_attn.sinks", "layers.1.attn.attn_sink"),
                         ("model.layers.1.self_attn.compressor.position_bias", "layers.1.attn.compressor.ape"),
                         ("model.layers.2.mlp.gate.weight", "layers.2.ffn.gate.weight"),
                         ("model.layers.3.attn_hc.base", "layers.3.hc_attn_base"),
                         ("model.embed_tokens.weight", "embed.weight")]:
        got = params[theirs]
        assert torch.equal(got, ck.get(ours).to(got.dtype)), theirs  # loaded as stored (or cast to bf16)
    assert torch.equal(buffers["model.layers.0.mlp.gate.tid2eid"], ck.get("layers.0.ffn.gate.tid2eid"))
    assert torch.equal(buffers["model.layers.2.mlp.gate.e_score_correction_bias"], ck.get("layers.2.ffn.gate.bias"))
    # their RoPE tables (float32 math) agree with ours (float64 math, rounded) to float32 precision
    torch.testing.assert_close(buffers["model.rotary_emb.main_inv_freq"], ck.config.rope_main.inv_freq(),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(buffers["model.rotary_emb.compress_inv_freq"], ck.config.rope_compress.inv_freq(),
                               rtol=1e-6, atol=0)


def test_fp8_experts_checkpoint_loads_cleanly(hf_fp8, tiny_ckpt_fp8_experts):
    """The Base format (FP8 experts, float32 block scales) also loads through transformers' dequantizer."""
    model, info = hf_fp8
    _assert_clean(info)
    ck = Checkpoint(tiny_ckpt_fp8_experts)
    c = ck.config
    assert c.expert_dtype == "fp8" and c.quant.scale_fmt is None
    params = dict(model.named_parameters())
    inter = c.moe_intermediate_size
    gate_up = params["model.layers.2.mlp.experts.gate_up_proj"]
    down = params["model.layers.2.mlp.experts.down_proj"]
    for e in (0, c.n_routed_experts - 1):
        def fp8(w):
            stem = f"layers.2.ffn.experts.{e}.{w}"
            s = ck.get(f"{stem}.scale")
            assert s.dtype == torch.float32
            return dequantize_block_fp8(ck.get(f"{stem}.weight"), s).to(torch.bfloat16)

        assert torch.equal(gate_up[e, :inter], fp8("w1")), e
        assert torch.equal(gate_up[e, inter:], fp8("w3")), e
        assert torch.equal(down[e], fp8("w2")), e
    want = dequantize_block_fp8(ck.get("layers.2.attn.wq_a.weight"), ck.get("layers.2.attn.wq_a.scale"))
    assert torch.equal(params["model.layers.2.self_attn.q_a_proj.weight"], want.to(torch.bfloat16))
    _forward_is_finite(model, c.vocab_size)
