"""Two FP8 projections of one input in one GEMM: the attention's [wq_a; wkv] and the shared expert's [w1; w3].

On the fast path (FP8 weights with an ``fp8_linear`` op) ``stack_fp8_rows`` holds each pair as one stacked
weight, built once at load, and the model multiplies it in one launch. The stacked weight reduces K in the
chunks of its own shape (``invariant_chunk``), so its halves may differ from the separate calls by
summation order only: within the tolerance of the fp8_linear tests (``assert_fp32_accum_close``; bf16
outputs one bf16 spacing more). The halves reach their readers (rms_norm, the window KV path, swiglu_act)
as views of the one output, no copies.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import BF16_SPACING_MAX, DEV, assert_fp32_accum_close, gen, randn  # noqa: E402

from dsv4.checkpoint.reader import Checkpoint  # noqa: E402
from dsv4.formats import OCP, dequantize_block_fp8, fake_quant_fp8_pow2, quantize_block_fp8  # noqa: E402
from dsv4.model.attention import Attention  # noqa: E402
from dsv4.model.cache import CacheNumerics, DenseSequenceCache  # noqa: E402
from dsv4.model.linear import linear  # noqa: E402
from dsv4.model.moe import MoE  # noqa: E402
from dsv4.model.opset import OpSet  # noqa: E402
from dsv4.model.step import SeqChunk, Step  # noqa: E402
from dsv4.model.weights import FP8Weight, ModelWeights, stack_fp8_rows  # noqa: E402
from dsv4.ops import torch_ops  # noqa: E402
from dsv4.ops.triton import fp8_linear as tfl  # noqa: E402


def _fp8(n, k, g, op):
    wq, s = quantize_block_fp8(torch.randn(n, k, generator=g) * 0.05, scale_fmt="ue8m0", fmt=OCP)
    return FP8Weight(wq.to(DEV), s.to(DEV), op)


class _Store:
    """A weight store as ``ModelWeights`` keeps one (``t``: name -> weight)."""

    def __init__(self, t):
        self.t = t

    def __getitem__(self, name):
        return self.t[name]


def _assert_close(got, want, x, w, act_quant):
    """The fp8_linear tests' bound: fp32 sums of the same products in another order (bf16: one more rounding)."""
    xq = fake_quant_fp8_pow2(x.float(), 128, OCP).to(x.dtype) if act_quant else x
    ap = xq.float().abs() @ dequantize_block_fp8(w.weight, w.scale, out_dtype=x.dtype).float().abs().T
    if got.dtype == torch.float32:
        assert_fp32_accum_close(got, want, ap)
    else:
        d = (got.float() - want.float()).abs()
        assert bool((d <= BF16_SPACING_MAX * want.float().abs() + 1e-5 * ap + 1e-30).all()), d.max()


def _rows_with_other_chunks(na: int, k: int, dev: torch.device) -> int:
    """The fewest rows b (whole scale blocks) for which [a; b] reduces K in other chunks than a alone: the
    chunks follow the SM count (``invariant_chunk``), so the case the test is about needs a device's own b
    (8 "SMs" in the interpreter: 128 rows; an H200's 132: 2048)."""
    for nb in range(128, 64 * 1024 + 1, 128):
        if tfl.invariant_chunk(na, k, dev) != tfl.invariant_chunk(na + nb, k, dev):
            return nb
    pytest.fail(f"no b up to 64K rows changes the K chunks of [{na}, {k}] on {dev}")


@pytest.mark.parametrize("act_quant", [False, True], ids=["plain", "act_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_stacked_gemm_is_the_two_calls_within_tolerance(m, dtype, act_quant):
    """[a; b] in one fp8_linear launch against a and b each in its own, on fresh random inputs, at decode
    and prefill sizes; the stacked weight's K chunks differ from a's here, so the bits may differ."""
    g = gen(1000 + m)
    k, na = 1024, 128
    nb = _rows_with_other_chunks(na, k, torch.device(DEV))
    store = _Store({"a": _fp8(na, k, g, tfl.fp8_linear), "b": _fp8(nb, k, g, tfl.fp8_linear)})
    a0, b0 = store["a"], store["b"]
    a, b, both = stack_fp8_rows(store, "a", "b")
    assert both is not None and tuple(both.shape) == (na + nb, k)
    assert store["a"] is a and store["b"] is b and a.weight.data_ptr() == both.weight.data_ptr()
    assert torch.equal(a.weight.view(torch.uint8), a0.weight.view(torch.uint8)) and torch.equal(a.scale, a0.scale)
    assert torch.equal(b.weight.view(torch.uint8), b0.weight.view(torch.uint8)) and torch.equal(b.scale, b0.scale)
    x = randn((m, k), g, dtype=dtype)
    x[0, :7] *= 40.0  # one 128-block of larger scale (act_quant: its own power of two)
    ya, yb = linear(x, both, act_quant).split([na, nb], dim=-1)
    _assert_close(ya, linear(x, a0, act_quant), x, a0, act_quant)
    _assert_close(yb, linear(x, b0, act_quant), x, b0, act_quant)


@pytest.mark.parametrize("op", [tfl.fp8_linear, torch_ops.fp8_linear], ids=["triton", "torch"])
def test_act_quant_reaches_the_fp8_op(op):
    """``linear(x, w, act_quant=True)`` with an FP8 weight hands the rounding to its fp8_linear op (the Triton one
    quantizes x in one launch; the model's torch rounding took ~20 small kernels a call): the output is the op's
    on the codec's rounded x, bit for bit, and the op was asked for OCP, the format the model rounds to."""
    g = gen(5)
    calls = []

    def spy(*a, **kw):
        calls.append(kw)
        return op(*a, **kw)

    w = _fp8(256, 384, g, spy)
    x = randn((3, 384), g, dtype=torch.bfloat16)
    got = linear(x, w, act_quant=True)
    assert calls == [{"act_quant": True, "act_fmt": OCP}]
    xq = fake_quant_fp8_pow2(x.float(), 128, OCP).to(x.dtype)
    assert torch.equal(got, op(xq, w.weight, w.scale))
    assert torch.equal(linear(x, FP8Weight(w.weight, w.scale, None), act_quant=True),
                       linear(xq, FP8Weight(w.weight, w.scale, None)))  # no op: rounded here, then dequantized


def test_stacked_only_when_both_are_fp8_weights_with_one_op_k_and_whole_scale_blocks():
    g = gen(3)
    op = tfl.fp8_linear
    a, b = _fp8(128, 256, g, op), _fp8(256, 256, g, op)
    cases = {
        "dequantized tensors (the oracle)": (a.dequantize(torch.float32), b.dequantize(torch.float32)),
        "no op (dequantized per call)": (FP8Weight(a.weight, a.scale, None), FP8Weight(b.weight, b.scale, None)),
        "two ops": (a, FP8Weight(b.weight, b.scale, torch_ops.fp8_linear)),
        "another K": (a, _fp8(128, 384, g, op)),
        "rows not whole scale blocks": (_fp8(64, 256, g, op), b),
        "one FP8, one tensor": (a, b.dequantize(torch.float32)),
    }
    for what, (wa, wb) in cases.items():
        store = _Store({"a": wa, "b": wb})
        got_a, got_b, both = stack_fp8_rows(store, "a", "b")
        assert both is None and got_a is wa and got_b is wb and store["a"] is wa, what
    assert stack_fp8_rows({"a": a, "b": b}, "a", "b")[2] is not None  # a plain dict: stacked, nothing replaced


def _layer_weights(ckpt, prefix, op):
    names = [n for n in ckpt.specs if n.startswith(prefix + ".")]
    return ModelWeights(ckpt, torch.float32, device=DEV, progress=False, names=names,
                        keep_quantized=op is not None, fp8_linear=op)


def _spying(ops, name, calls):
    fn = getattr(ops, name)

    def spy(*a, **kw):
        out = fn(*a, **kw)
        calls.append((a, out))
        return out

    setattr(ops, name, spy)


@pytest.mark.parametrize("act_quant", [False, True], ids=["plain", "act_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_projects_q_latent_and_kv_in_one_launch(tiny_ckpt, dtype, act_quant):
    """The attention's fast path: [wq_a; wkv] multiplied once; the q latent reaches rms_norm and kv_raw the
    window KV's norm as views of that one output; each half is the separate call's within tolerance."""
    ckpt = Checkpoint(tiny_ckpt)
    cfg, layer = ckpt.config, 1
    ops = OpSet({"fp8_linear": tfl.fp8_linear})
    w = _layer_weights(ckpt, f"layers.{layer}", ops.fp8_linear)
    attn = Attention(w, layer, cfg, ops, act_quant=act_quant)
    nq, nkv = cfg.q_lora_rank, cfg.head_dim
    assert attn.wq_a_kv is not None and tuple(attn.wq_a_kv.shape) == (nq + nkv, cfg.hidden_size)
    assert w[f"layers.{layer}.attn.wq_a.weight"] is attn.wq_a and w[f"layers.{layer}.attn.wkv.weight"] is attn.wkv
    assert attn.wkv.weight.data_ptr() == attn.wq_a_kv.weight[nq:].data_ptr()
    lin, norms = [], []
    _spying(ops, "linear", lin)
    _spying(ops, "rms_norm", norms)
    x = randn((6, cfg.hidden_size), gen(11), dtype=dtype)
    cache = DenseSequenceCache(cfg, CacheNumerics("auto"))
    attn.forward(x, Step.of([SeqChunk(cache, 0, x.shape[0])], x.device))
    (args, y), = [(a, out) for a, out in lin if a[1] is attn.wq_a_kv]
    assert not any(a[1] is attn.wq_a or a[1] is attn.wkv for a, _ in lin)  # no separate launches
    q_lat, kv_raw = norms[0][0][0], norms[1][0][0]  # rms_norm(q latent), then the window KV's rms_norm(kv_raw)
    assert q_lat.data_ptr() == y.data_ptr() and kv_raw.data_ptr() == y[:, nq:].data_ptr()
    assert q_lat.shape == (6, nq) and kv_raw.shape == (6, nkv) and q_lat.stride(0) == kv_raw.stride(0) == nq + nkv
    _assert_close(q_lat, linear(x, attn.wq_a, act_quant), x, attn.wq_a, act_quant)
    _assert_close(kv_raw, linear(x, attn.wkv, act_quant), x, attn.wkv, act_quant)


@pytest.mark.parametrize("act_quant", [False, True], ids=["plain", "act_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_expert_gate_and_up_in_one_launch(tiny_ckpt, dtype, act_quant):
    """The shared expert's fast path: [w1; w3] multiplied once, gate and up handed to swiglu_act (the Triton
    kernel) as views of that output; each is the separate call's within tolerance, and the expert's output
    is w2 of swiglu_act(gate, up)."""
    from dsv4.ops.triton import activation

    ckpt = Checkpoint(tiny_ckpt)
    cfg, layer = ckpt.config, 2
    ops = OpSet({"fp8_linear": tfl.fp8_linear, "swiglu_act": activation.swiglu_act})
    w = _layer_weights(ckpt, f"layers.{layer}", ops.fp8_linear)
    moe = MoE(w, f"layers.{layer}.ffn", cfg, cfg.is_hash_layer(layer), act_quant, ops)
    w1, w3, w2 = moe.shared
    n = w1.shape[0]
    assert moe.shared_w13 is not None and tuple(moe.shared_w13.shape) == (2 * n, cfg.hidden_size)
    assert w3.weight.data_ptr() == moe.shared_w13.weight[n:].data_ptr()
    lin, acts = [], []
    _spying(ops, "linear", lin)
    _spying(ops, "swiglu_act", acts)
    x = randn((7, cfg.hidden_size), gen(12), dtype=dtype)
    out = moe._shared_expert(x)
    assert [a[1] for a, _ in lin] == [moe.shared_w13, w2]
    y = lin[0][1]
    (gate, up, *_), h = acts[0]
    assert gate.data_ptr() == y.data_ptr() and up.data_ptr() == y[:, n:].data_ptr() and gate.stride(0) == 2 * n
    _assert_close(gate, linear(x, w1, act_quant), x, w1, act_quant)
    _assert_close(up, linear(x, w3, act_quant), x, w3, act_quant)
    assert torch.equal(h, activation.swiglu_act(gate.contiguous(), up.contiguous(), cfg.swiglu_limit, dtype))
    assert torch.equal(out, linear(h, w2, act_quant))


def test_models_stack_on_the_fast_path_only(tiny_dspark_ckpt):
    """Every attention (the DSpark stages' included: their context KV reads ``wkv`` alone, a view) and every
    shared expert holds the stacked weight when its weights stay FP8 with an op; the oracle's dequantized
    model keeps two weights and two calls."""
    from dsv4.model.model import ReferenceModel

    fast = ReferenceModel(tiny_dspark_ckpt, ops=OpSet({"fp8_linear": torch_ops.fp8_linear}))
    oracle = ReferenceModel(tiny_dspark_ckpt)
    for b in fast.blocks + fast.mtp:
        nq = b.attn.wq_a.shape[0]
        assert b.attn.wq_a_kv is not None and b.attn.wkv.weight.data_ptr() == b.attn.wq_a_kv.weight[nq:].data_ptr()
        w1, w3, _ = b.moe.shared
        assert b.moe.shared_w13 is not None and w3.weight.data_ptr() == b.moe.shared_w13.weight[w1.shape[0]:].data_ptr()
    for b in oracle.blocks + oracle.mtp:
        assert b.attn.wq_a_kv is None and isinstance(b.attn.wq_a, torch.Tensor)
        assert b.moe.shared_w13 is None and isinstance(b.moe.shared[0], torch.Tensor)
