"""stack_experts keeps checkpoint bytes; the torch ops reproduce dsv4.model's MoE on a real (synthetic) checkpoint."""

import pytest
import torch

from dsv4.formats import quantize_block_fp8, quantize_mxfp4
from dsv4.formats.experts import expert_dtype_of, stack_experts, stack_experts_from_checkpoint
from dsv4.ops import torch_ops

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def test_stack_fp4_keeps_bytes():
    g = torch.Generator().manual_seed(0)
    n, inter, hidden = 3, 64, 96
    parts = {k: [] for k in ("w1", "s1", "w3", "s3", "w2", "s2")}
    for _ in range(n):
        for name, (o, i) in (("1", (inter, hidden)), ("3", (inter, hidden)), ("2", (hidden, inter))):
            w, s = quantize_mxfp4(torch.randn(o, i, generator=g))
            parts["w" + name].append(w)  # int8, as in the checkpoint
            parts["s" + name].append(s.view(E8M0) if E8M0 is not None else s)
    w13, s13, w2, s2 = stack_experts(*[parts[k] for k in ("w1", "s1", "w3", "s3", "w2", "s2")])
    assert (w13.dtype, s13.dtype, w2.dtype, s2.dtype) == (torch.uint8,) * 4
    assert w13.shape == (n, 2 * inter, hidden // 2) and s13.shape == (n, 2 * inter, hidden // 32)
    assert w2.shape == (n, hidden, inter // 2) and s2.shape == (n, hidden, inter // 32)
    # scales groups-major: a K step's bytes of adjacent rows adjacent (what the grouped kernels read)
    assert s13.stride()[1:] == (1, 2 * inter) and s2.stride()[1:] == (1, hidden)
    for e in range(n):
        assert torch.equal(s13[e, :inter], parts["s1"][e].view(torch.uint8))
        assert torch.equal(w13[e, :inter], parts["w1"][e].view(torch.uint8))
        assert torch.equal(w13[e, inter:], parts["w3"][e].view(torch.uint8))
        assert torch.equal(s13[e, inter:], parts["s3"][e].view(torch.uint8))
        assert torch.equal(w2[e], parts["w2"][e].view(torch.uint8))
        assert torch.equal(s2[e], parts["s2"][e].view(torch.uint8))


def test_stack_fp8_partial_blocks_and_getter():
    g = torch.Generator().manual_seed(1)
    inter, hidden = 160, 128  # ceil(160/128) = 2 scale rows per projection
    tensors = {}
    for e in range(2):
        for w, (o, i) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            q, s = quantize_block_fp8(torch.randn(o, i, generator=g), scale_fmt="fp32")
            tensors[f"layers.5.ffn.experts.{e}.{w}.weight"] = q
            tensors[f"layers.5.ffn.experts.{e}.{w}.scale"] = s
    w13, s13, w2, s2 = stack_experts_from_checkpoint(tensors.__getitem__, "layers.5.ffn", 2)
    assert w13.dtype == torch.float8_e4m3fn and s13.dtype == torch.float32
    assert s13.shape == (2, 4, 1) and s2.shape == (2, 1, 2)
    assert torch.equal(s13[1, 2:], tensors["layers.5.ffn.experts.1.w3.scale"])
    assert torch.equal(w13[1, inter:].view(torch.uint8), tensors["layers.5.ffn.experts.1.w3.weight"].view(torch.uint8))
    assert expert_dtype_of(w13) == "fp8"


@pytest.mark.parametrize("layer,act_quant", [(0, False), (2, False), (2, True)])  # tiny: layer 0 is hash-routed
def test_ops_reproduce_reference_moe(tiny_ckpt, layer, act_quant):
    """The grouped ops against the model's per-expert path (``linear`` per expert GEMM), also with the release's FP8
    activations (x and the SwiGLU output rounded per 128 columns before each expert GEMM)."""
    from dsv4.checkpoint.reader import Checkpoint
    from dsv4.model.linear import linear
    from dsv4.model.moe import MoE, route
    from dsv4.model.opset import reference_ops
    from dsv4.model.weights import ModelWeights

    ck = Checkpoint(tiny_ckpt)
    cfg = ck.config
    prefix = f"layers.{layer}.ffn"
    hashed = cfg.is_hash_layer(layer)
    assert hashed == (layer == 0)
    mw = ModelWeights(ck, torch.float32, progress=False, names=[n for n in ck.specs if n.startswith(prefix + ".")])
    moe = MoE(mw, prefix, cfg, hashed, act_quant, reference_ops())
    moe.shared = None  # routed experts only
    g = torch.Generator().manual_seed(layer)
    t = 2
    x = torch.randn(t, cfg.hidden_size, generator=g)
    tok = torch.randint(0, cfg.vocab_size + 50, (t,), generator=g)  # includes out-of-range ids
    ref = moe.forward(x, tok)

    logits = linear(x.float(), moe.gate.float())
    hash_ids = moe.tid2eid[tok.clamp(0, moe.tid2eid.shape[0] - 1)] if hashed else None
    ids, w = torch_ops.moe_route(logits, moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                                 cfg.norm_topk_prob, hash_ids)
    ids_ref, w_ref = route(moe.ops, x, moe.gate, cfg, moe.bias, moe.tid2eid, tok)
    assert torch.equal(ids.long(), ids_ref) and torch.equal(w, w_ref)

    layer_w = stack_experts_from_checkpoint(ck.get, prefix, cfg.n_routed_experts)
    y = torch_ops.moe_experts(x, ids, w, *layer_w, cfg.swiglu_limit, cfg.expert_dtype, act_quant=act_quant)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())

    pytest.importorskip("triton", reason="triton is not installed")
    from ops_kernel_helpers import DEV

    from dsv4.ops.triton import moe as tmoe

    def d(v):
        return None if v is None else v.to(DEV)

    ids_t, w_t = tmoe.moe_route(d(logits), d(moe.bias), cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                                cfg.norm_topk_prob, d(hash_ids))
    assert torch.equal(ids_t.cpu(), ids) and torch.equal(w_t.cpu(), w)
    y_t = tmoe.moe_experts(d(x), ids_t, w_t, *[d(v) for v in layer_w], cfg.swiglu_limit, cfg.expert_dtype,
                           act_quant=act_quant, config={"BLOCK_N": 128, "direct": False})
    torch.testing.assert_close(y_t.cpu(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
