"""Hand-checked units of the reference model: each expected value is computed here, in float64
loops or closed forms, from the spec (docs/numerics.md, shared/reference/model-and-formats.md
§5-8) — never by calling the function under test a second time.

Tolerances: the model computes in float32 (GEMMs) with float64 transcendentals, so values of
order 1 agree with float64 to ~1e-6; 1e-5 is used unless stated. Where a test could pass by
accident (a transposed matrix, a missing clamp), it also checks that the wrong variant differs.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsv4.model.attention as attn_mod
from dsv4.config import LayerType
from dsv4.model.attention import sparse_attention
from dsv4.model.mhc import hc_post, hc_pre, sinkhorn
from dsv4.model.moe import route, swiglu
from dsv4.model.opset import reference_ops
from dsv4.model.rope import apply_rope, cos_sin
from dsv4.model.step import SeqChunk

F64 = torch.float64


def _rand(*shape, seed=0, std=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * std).to(dtype)


@pytest.fixture(scope="module")
def cfg(tiny_model_auto):
    return tiny_model_auto.cfg


# ---- mHC -------------------------------------------------------------------------------------

def _hand_sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column-normalise, then (iters−1) × (row, column); loops over single matrices."""
    out = torch.empty_like(c)
    for t in range(c.shape[0]):
        m = c[t].clone()
        for j in range(m.shape[1]):
            m[:, j] = m[:, j] / (m[:, j].sum() + eps)
        for _ in range(iters - 1):
            for i in range(m.shape[0]):
                m[i, :] = m[i, :] / (m[i, :].sum() + eps)
            for j in range(m.shape[1]):
                m[:, j] = m[:, j] / (m[:, j].sum() + eps)
        out[t] = m
    return out


def test_sinkhorn_is_doubly_stochastic():
    """Columns (the last normalisation) sum to 1 always; rows reach 1e-5 within the spec's 20
    iterations for mild mixes. For peaked mixes 20 iterations are a truncation: measured max row
    deviation 2.8e-4 at logit std 1, 4.6e-2 at std 3 (and 1.3e-2 for one token of a real ``tiny``
    forward) — the spec (hc_sinkhorn_iters = 20, as vLLM and transformers), not an error: the same
    code converges to 1e-5 given more iterations (std 2: 300 iterations; std 3 needs ~3000)."""
    ones = torch.ones(512, 4, dtype=F64)
    mild = torch.softmax(_rand(512, 4, 4, seed=1, std=0.5, dtype=F64), dim=-1) + 1e-6
    comb = sinkhorn(mild, 20, 1e-6)
    assert (comb > 0).all()
    assert torch.allclose(comb.sum(-1), ones, atol=1e-5, rtol=0)  # rows
    assert torch.allclose(comb.sum(-2), ones, atol=1e-5, rtol=0)  # columns
    peaked = torch.softmax(_rand(512, 4, 4, seed=1, std=2.0, dtype=F64), dim=-1) + 1e-6
    comb = sinkhorn(peaked, 20, 1e-6)
    assert torch.allclose(comb.sum(-2), ones, atol=1e-5, rtol=0)
    assert (comb.sum(-1) - 1).abs().max() > 1e-3  # truncated: rows not yet converged (measured 2.4e-2)
    comb = sinkhorn(peaked, 300, 1e-6)
    assert torch.allclose(comb.sum(-1), ones, atol=1e-5, rtol=0)
    assert torch.allclose(comb.sum(-2), ones, atol=1e-5, rtol=0)


def test_hc_pre_against_float64_hand_computation():
    T, n, H, eps, rms_eps = 6, 4, 256, 1e-6, 1e-6
    streams = _rand(T, n, H, seed=2)
    fn = _rand(24, n * H, seed=3, std=(n * H) ** -0.5)
    base, scale = _rand(24, seed=4, std=0.5), torch.tensor([0.7, 0.9, 0.6])
    collapsed, post, comb = hc_pre(reference_ops(), streams, fn, base, scale, 20, eps, rms_eps)

    X = streams.reshape(T, -1).double()
    mixes = (X / torch.sqrt(X.square().mean(-1, keepdim=True) + rms_eps)) @ fn.double().T
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(mixes[:, :n] * s[0] + b[:n]) + eps  # no normalisation to sum 1
    post_h = 2.0 * torch.sigmoid(mixes[:, n:2 * n] * s[1] + b[n:2 * n])
    comb0 = torch.softmax(mixes[:, 2 * n:].view(T, n, n) * s[2] + b[2 * n:].view(n, n), dim=-1) + eps
    comb_h = _hand_sinkhorn(comb0, 20, eps)
    coll_h = sum(pre[:, i:i + 1] * streams[:, i].double() for i in range(n))

    assert torch.allclose(post.double(), post_h, atol=1e-5, rtol=0)
    assert torch.allclose(comb.double(), comb_h, atol=1e-5, rtol=0)
    assert torch.allclose(collapsed.double(), coll_h, atol=1e-5, rtol=1e-5)
    assert torch.allclose(comb.double().sum(-1), torch.ones(T, n, dtype=F64), atol=1e-5)
    assert torch.allclose(comb.double().sum(-2), torch.ones(T, n, dtype=F64), atol=1e-5)
    assert (post > 0).all() and (post < 2).all()


def test_hc_post_sums_over_first_index_of_comb():
    T, n, H = 3, 4, 16
    streams, out = _rand(T, n, H, seed=5), _rand(T, H, seed=6)
    post = torch.rand(T, n, generator=torch.Generator().manual_seed(7)) * 2
    comb = torch.rand(T, n, n, generator=torch.Generator().manual_seed(8))  # non-symmetric
    got = hc_post(streams, out, post, comb).double()
    want = torch.zeros(T, n, H, dtype=F64)
    wrong = torch.zeros(T, n, H, dtype=F64)
    for t in range(T):
        for j in range(n):
            want[t, j] = post[t, j].double() * out[t].double()
            wrong[t, j] = want[t, j].clone()
            for i in range(n):
                want[t, j] += comb[t, i, j].double() * streams[t, i].double()  # R'[j] = Σ_i comb[i, j] R[i]
                wrong[t, j] += comb[t, j, i].double() * streams[t, i].double()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (got - wrong).abs().max() > 1e-2  # the transposed reading would fail this test


# ---- RoPE ------------------------------------------------------------------------------------

def test_compress_rope_yarn_frequencies(cfg):
    rp = cfg.rope_compress
    assert (rp.theta, rp.dim, rp.yarn_factor, rp.original_max_position) == (160000.0, 64, 16.0, 65536)
    assert rp.yarn_correction_range() == (15, 25)  # floor(15.45), ceil(24.71)
    got = rp.inv_freq().double()
    base = torch.tensor([160000.0 ** (-2 * i / 64) for i in range(32)], dtype=F64)
    for i in range(32):
        if i <= 15:
            want = base[i]  # extrapolated: unchanged
        elif i >= 25:
            want = base[i] / 16  # interpolated
        else:
            r = (i - 15) / 10  # linear ramp between the correction dims
            want = base[i] / 16 * r + base[i] * (1 - r)
        assert math.isclose(float(got[i]), float(want), rel_tol=1e-6), i
    assert math.isclose(float(got[20]), float(base[20]) * (1 + 1 / 16) / 2, rel_tol=1e-6)  # half-mixed
    # the main (sliding-window) RoPE is plain: theta 10000, no YaRN
    main = cfg.rope_main.inv_freq().double()
    assert torch.allclose(main, torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=F64), rtol=1e-6)
    assert cfg.rope(0) == cfg.rope_main and cfg.rope(1) == rp and cfg.rope(2) == rp
    assert cfg.rope(cfg.num_hidden_layers) == cfg.rope_main  # the MTP layer is sliding-window


def test_apply_rope_is_interleaved_on_last_64_dims(cfg):
    rp = cfg.rope_compress
    pos = torch.tensor([0, 1, 7, 77])
    x = _rand(4, 2, 512, seed=9)
    cos, sin = cos_sin(rp, pos)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., :448], x[..., :448])  # NoPE dims untouched
    inv = rp.inv_freq().double()
    want = x.double().clone()
    for t, p in enumerate(pos.tolist()):
        for i in range(32):
            th = p * float(inv[i])
            e, o = x[t, :, 448 + 2 * i].double(), x[t, :, 449 + 2 * i].double()  # pair (2i, 2i+1)
            want[t, :, 448 + 2 * i] = e * math.cos(th) - o * math.sin(th)
            want[t, :, 449 + 2 * i] = o * math.cos(th) + e * math.sin(th)
    assert torch.allclose(y.double(), want, atol=2e-5, rtol=0)
    # a unit vector on dim 448+2i turns within its own pair (GPT-J), not into dim 448+i+32 (NeoX)
    u = torch.zeros(4, 1, 512)
    u[:, :, 448 + 6] = 1.0
    ru = apply_rope(u, cos, sin)
    assert torch.allclose(ru[:, 0, 454].double(), torch.cos(pos * inv[3]), atol=5e-6)
    assert torch.allclose(ru[:, 0, 455].double(), torch.sin(pos * inv[3]), atol=5e-6)
    others = torch.ones(512, dtype=torch.bool)
    others[454:456] = False
    assert ru[:, 0, others].abs().max() == 0
    # the inverse rotation (negated angle) undoes it
    assert torch.allclose(apply_rope(y, cos, sin, inverse=True), x, atol=1e-6, rtol=0)


# ---- compressor ------------------------------------------------------------------------------

def _hand_rope_at(v: torch.Tensor, p: int, inv: torch.Tensor) -> torch.Tensor:
    """GPT-J rotation of the last 64 dims of one vector at position p."""
    v = v.clone()
    for i in range(32):
        th, k = p * float(inv[i]), v.shape[0] - 64 + 2 * i
        e, o = float(v[k]), float(v[k + 1])
        v[k], v[k + 1] = e * math.cos(th) - o * math.sin(th), o * math.cos(th) + e * math.sin(th)
    return v


def _hand_pool(kv_rows: torch.Tensor, score_rows: torch.Tensor, norm_w: torch.Tensor, eps: float):
    w = torch.softmax(score_rows, dim=0)  # per channel, over rows; −inf rows get weight 0
    pooled = (kv_rows * w).sum(0)
    return pooled / torch.sqrt(pooled.square().mean() + eps) * norm_w


@torch.no_grad()
def test_compressor_overlap_windows(tiny_model_auto):
    """Ratio 4 (overlap): block 0 pools only its own 4 rows (second half of the state columns;
    the previous-block half is masked); block b ≥ 1 pools rows of block b−1 (first half, Ca)
    and rows of block b (second half, Cb). Entry b gets RoPE at position 4b."""
    model = tiny_model_auto
    comp = model.blocks[1].attn.compressor
    assert (comp.ratio, comp.kind, comp.overlap) == (4, "kv", True)
    d, width, T, eps = comp.dim, comp.wkv.shape[0], 12, model.cfg.rms_norm_eps
    assert width == 2 * d
    x = _rand(T, model.cfg.hidden_size, seed=10)
    cache = model.new_cache()
    comp.run(x, SeqChunk(cache, 0, T))
    S = cache.read_state(1, "kv", torch.arange(T)).double()
    # state rows [kv | score + ape[p % 4]] (fp32 GEMM vs float64)
    xd = x.double()
    S_h = torch.cat([xd @ comp.wkv.double().T, xd @ comp.wgate.double().T + comp.ape.double()[torch.arange(T) % 4]], -1)
    assert torch.allclose(S, S_h, atol=1e-5, rtol=1e-5)

    got = cache.read_compressed(1, "kv", torch.arange(3)).double()
    inv = model.cfg.rope_compress.inv_freq().double()
    nw = comp.norm.double()
    kv, sc = S[:, :width], S[:, width:]
    for b in range(3):
        cur = slice(4 * b, 4 * b + 4)
        if b == 0:
            rows_kv, rows_sc = kv[cur, d:], sc[cur, d:]
        else:
            prev = slice(4 * b - 4, 4 * b)
            rows_kv = torch.cat([kv[prev, :d], kv[cur, d:]])
            rows_sc = torch.cat([sc[prev, :d], sc[cur, d:]])
        want = _hand_rope_at(_hand_pool(rows_kv, rows_sc, nw, eps), 4 * b, inv)
        assert torch.allclose(got[b], want, atol=1e-5, rtol=1e-5), f"entry {b}"
    # the checks discriminate: an unmasked (score 0, kv 0) previous half at block 0, or swapped
    # halves at block 1, give different entries
    unmasked = _hand_pool(torch.cat([torch.zeros(4, d, dtype=F64), kv[0:4, d:]]),
                          torch.cat([torch.zeros(4, d, dtype=F64), sc[0:4, d:]]), nw, eps)
    assert (got[0] - unmasked).abs().max() > 1e-2
    swapped = _hand_rope_at(_hand_pool(torch.cat([kv[0:4, d:], kv[4:8, :d]]), torch.cat([sc[0:4, d:], sc[4:8, :d]]),
                                       nw, eps), 4, inv)
    assert (got[1] - swapped).abs().max() > 1e-2


@torch.no_grad()
def test_compressor_ratio_128_no_overlap(tiny_model_auto):
    model = tiny_model_auto
    comp = model.blocks[2].attn.compressor
    assert (comp.ratio, comp.overlap, comp.wkv.shape[0]) == (128, False, comp.dim)
    x = _rand(129, model.cfg.hidden_size, seed=11)
    cache = model.new_cache()
    comp.run(x[:127], SeqChunk(cache, 0, 127))
    with pytest.raises(RuntimeError):  # nothing emitted before the block closes
        cache.read_compressed(2, "kv", torch.arange(1))
    comp.run(x[127:], SeqChunk(cache, 127, 2))
    S = cache.read_state(2, "kv", torch.arange(128)).double()
    want = _hand_pool(S[:, :comp.dim], S[:, comp.dim:], comp.norm.double(), model.cfg.rms_norm_eps)  # rope at 0 = id
    got = cache.read_compressed(2, "kv", torch.arange(1))[0].double()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


# ---- visibility, through attention -----------------------------------------------------------

def _hand_attention(q, keys, sink, scale):
    """q [h, d], keys [L, d] (K = V), sink [h]: softmax with one extra zero-valued key of logit sink."""
    logits = (q.double() @ keys.double().T) * scale  # [h, L]
    m = torch.maximum(logits.max(-1).values, sink.double())
    e = torch.exp(logits - m[:, None])
    denom = e.sum(-1) + torch.exp(sink.double() - m)
    return (e / denom[:, None]) @ keys.double()


@torch.no_grad()
def test_compressed_visibility_through_attention(tiny_model_auto, monkeypatch):
    """Compressed entry b is visible to the query at p iff b < (p+1)//ratio (the block containing
    p is visible only once p closes it). Checked on the key lists attention receives and on its
    output against a float64 softmax over exactly the expected keys (window (p−128, p] + visible
    entries + sink). CSA positions ≤ 130 have ≤ 32 visible entries, so top-32 keeps all of them."""
    model, T = tiny_model_auto, 260
    calls = []
    orig = attn_mod.sparse_attention

    def spy(q, table, idx, sink, scale, check=None, **kw):
        out = orig(q, table, idx, sink, scale, check, **kw)
        calls.append((q.clone(), table.clone(), idx.clone(), sink.clone(), scale, out.clone()))
        return out

    monkeypatch.setattr(attn_mod, "sparse_attention", spy)
    ids = torch.randint(2, 129280, (T,), generator=torch.Generator().manual_seed(12))
    model.forward(ids, [SeqChunk(model.new_cache(), 0, T)], logits_rows=torch.tensor([T - 1]))
    assert len(calls) == model.cfg.num_hidden_layers
    w = model.cfg.sliding_window
    cases = {1: (4, [0, 2, 3, 4, 6, 7, 8, 126, 127, 128, 130]), 2: (128, [0, 126, 127, 128, 254, 255, 256, 259]),
             0: (0, [0, 127, 128, 259])}
    for layer, (ratio, positions) in cases.items():
        q, table, idx, sink, scale, out = calls[layer]
        n = T // ratio if ratio else 0
        assert table.shape[0] == n + T  # [compressed entries; window keys of positions 0..T-1]
        for p in positions:
            visible = list(range((p + 1) // ratio)) if ratio else []
            window = [n + j for j in range(max(0, p - w + 1), p + 1)]
            got = idx[p][idx[p] >= 0].tolist()
            assert sorted(got) == visible + window, f"layer {layer} p={p}"
            want = _hand_attention(q[p], table[torch.tensor(visible + window)], sink, scale)
            assert torch.allclose(out[p].double(), want, atol=1e-5, rtol=1e-5), f"layer {layer} p={p}"
    # the boundary itself: p = 126 does not see HCA entry 0, p = 127 does
    assert 0 not in calls[2][2][126].tolist() and 0 in calls[2][2][127].tolist()


# ---- attention sink --------------------------------------------------------------------------

def test_attention_sink_is_an_extra_zero_valued_key():
    t, h, d, n = 3, 2, 8, 150
    q, table = _rand(t, h, d, seed=13), _rand(n, d, seed=14)
    counts = [5, 130, 64]  # keys per query: one, three and exactly one 64-key block
    idx = torch.full((t, 130), -1, dtype=torch.long)
    g = torch.Generator().manual_seed(15)
    for r, c in enumerate(counts):
        idx[r, :c] = torch.randperm(n, generator=g)[:c]
    sink, scale = torch.tensor([0.5, -1.0]), 0.3
    out = sparse_attention(q, table, idx, sink, scale)
    plain = sparse_attention(q, table, idx, torch.full((h,), float("-inf")), scale)
    for r, c in enumerate(counts):
        keys = table[idx[r, :c]]
        assert torch.allclose(out[r].double(), _hand_attention(q[r], keys, sink, scale), atol=1e-6)
        # a −inf sink has no effect: plain softmax attention
        soft = torch.softmax((q[r].double() @ keys.double().T) * scale, -1) @ keys.double()
        assert torch.allclose(plain[r].double(), soft, atol=1e-6)
        # the sink is not multiplied by the softmax scale
        assert (out[r].double() - _hand_attention(q[r], keys, sink * scale, scale)).abs().max() > 1e-3


# ---- MoE -------------------------------------------------------------------------------------

def _hand_scores(x, gate_w):
    return torch.sqrt(torch.nn.functional.softplus(x.double() @ gate_w.double().T))


def test_hash_routing_uses_tid2eid_and_renormalised_scores(cfg):
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(16)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)])
    tokens = torch.tensor([3, 17, 17, 49, 0])
    x = _rand(5, cfg.hidden_size, seed=17)
    for gate_seed in (18, 19):  # whatever the gate scores, the experts come from the table
        gate_w = _rand(E, cfg.hidden_size, seed=gate_seed, std=cfg.hidden_size ** -0.5)
        gate_w[7] = x[0] * 5  # expert 7 has by far the best score for token 0
        ids, wts = route(reference_ops(), x, gate_w, cfg, None, tid2eid, tokens)
        assert torch.equal(ids, tid2eid[tokens])
        s = _hand_scores(x, gate_w).gather(1, ids)
        assert torch.allclose(wts.double(), s / s.sum(-1, keepdim=True) * 1.5, atol=1e-6)
    assert cfg.routed_scaling_factor == 1.5 and cfg.norm_topk_prob


def test_scored_routing_bias_selects_only_and_ties_go_low(cfg):
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    x = _rand(4, cfg.hidden_size, seed=20)
    gate_w = _rand(E, cfg.hidden_size, seed=21, std=cfg.hidden_size ** -0.5)
    s = _hand_scores(x, gate_w)
    best = s.argmax(-1)
    forced = next(e for e in range(E) if e not in best.tolist())
    bias = torch.zeros(E)
    bias[forced] = 100.0  # always selected
    bias[best] = -100.0  # never selected, though its score is the highest
    ids, wts = route(reference_ops(), x, gate_w, cfg, bias)
    for r in range(4):
        want = (s[r] + bias.double()).argsort(descending=True)[:k]
        assert sorted(ids[r].tolist()) == sorted(want.tolist())
        assert forced in ids[r].tolist() and int(best[r]) not in ids[r].tolist()
    sel = s.gather(1, ids)  # weights from the UNBIASED scores
    assert torch.allclose(wts.double(), sel / sel.sum(-1, keepdim=True) * 1.5, atol=1e-6)
    # ties: equal scores (zero gate) → lowest ids; bias 1 on experts 2 and 9 puts them first
    bias = torch.zeros(E)
    bias[2] = bias[9] = 1.0
    ids, wts = route(reference_ops(), x, torch.zeros(E, cfg.hidden_size), cfg, bias)
    assert all(sorted(r) == [0, 1, 2, 3, 4, 9] for r in ids.tolist())
    assert torch.allclose(wts, torch.full((4, k), 1.5 / k))


def test_hash_and_scored_layers_of_the_model(tiny_model_auto):
    m, cfg = tiny_model_auto, tiny_model_auto.cfg
    assert cfg.num_hash_layers == 2
    for i, b in enumerate(m.blocks):
        hashed = i < cfg.num_hash_layers
        assert (b.moe.tid2eid is not None) == hashed and (b.moe.bias is None) == hashed
    assert all(b.moe.tid2eid is None and b.moe.bias is not None for b in m.mtp)
    assert cfg.layer_type(cfg.num_hidden_layers) == LayerType.SWA


def _hand_swiglu(x, w1, w3, w2, limit):
    gate = (x.double() @ w1.double().T).clamp(max=limit)
    up = (x.double() @ w3.double().T).clamp(min=-limit, max=limit)
    return (torch.nn.functional.silu(gate) * up) @ w2.double().T


@torch.no_grad()
def test_moe_forward_against_hand_computation(tiny_model_auto):
    """Hash layer 0: out = Σ_k w_k · expert_{tid2eid[token], k}(x) + shared(x), shared at weight 1."""
    m, cfg = tiny_model_auto, tiny_model_auto.cfg
    moe = m.blocks[0].moe
    x = _rand(3, cfg.hidden_size, seed=22)
    tokens = torch.tensor([5, 1000, 129279])
    got = moe.forward(x, tokens).double()
    s = _hand_scores(x, moe.gate)
    want = _hand_swiglu(x, *moe.shared, cfg.swiglu_limit)
    for r, tok in enumerate(tokens.tolist()):
        ids = moe.tid2eid[tok].tolist()
        ws = s[r, ids] / s[r, ids].sum() * 1.5
        for e, we in zip(ids, ws):
            p = f"layers.0.ffn.experts.{e}"
            want[r] += we * _hand_swiglu(x[r:r + 1], m.w.expert(p + ".w1"), m.w.expert(p + ".w3"),
                                         m.w.expert(p + ".w2"), cfg.swiglu_limit)[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, moe.forward(x, torch.tensor([6, 1001, 129278])).double(), atol=1e-3)


def test_swiglu_clamps():
    """gate = min(w1·x, 10) (no lower clamp), up = clamp(w3·x, −10, 10). Unit by unit (w2 = I):
    unit 0: w1·x = 20 > 10 and w3·x = −15 < −10 (removing either clamp changes it);
    unit 1: nothing clamped; unit 2: w1·x = −30 (a lower gate clamp would change it);
    unit 3: w1·x = 12, w3·x = 11 (both clamp from above)."""
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    w1 = torch.zeros(4, 4)
    w3 = torch.zeros(4, 4)
    w1[:, 0] = torch.tensor([20.0, 3.0, -30.0, 12.0])
    w3[:, 0] = torch.tensor([-15.0, 2.0, 5.0, 11.0])
    w2 = torch.eye(4)
    got = swiglu(reference_ops(), x, w1, w3, w2, 10.0)[0].double()

    def silu(v):
        return v / (1 + math.exp(-v))

    want = torch.tensor([silu(10) * -10, silu(3) * 2, silu(-30) * 5, silu(10) * 10], dtype=F64)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)
    no_gate_clamp = silu(20) * -10
    no_up_clamp = silu(10) * -15
    gate_clamped_below = silu(-10) * 5
    assert abs(got[0] - no_gate_clamp) > 1 and abs(got[0] - no_up_clamp) > 1
    assert abs(got[2] - gate_clamped_below) > 1e-3


# ---- MTP -------------------------------------------------------------------------------------

@torch.no_grad()
def test_mtp_forward_from_target_streams(tiny_model_auto):
    model, T = tiny_model_auto, 136
    ids = torch.randint(2, 129280, (T + 1,), generator=torch.Generator().manual_seed(23))
    out = model.forward(ids[:T], [SeqChunk(model.new_cache(), 0, T)])
    logits = model.mtp_forward(ids[1:], out.streams, [SeqChunk(model.new_cache(), 0, T)]).logits
    assert logits.shape == (T, model.cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    draft = logits.argmax(-1)
    assert int(draft.min()) >= 0 and int(draft.max()) < model.cfg.vocab_size
    assert not torch.allclose(logits, out.logits)  # its own block and head, not the target's
    # the MTP layer keeps its own sliding-window cache: chunked == whole, bitwise
    cache = model.new_cache()
    a = model.mtp_forward(ids[1:101], out.streams[:100], [SeqChunk(cache, 0, 100)]).logits
    b = model.mtp_forward(ids[101:], out.streams[100:], [SeqChunk(cache, 100, T - 100)]).logits
    assert torch.equal(torch.cat([a, b]), logits)


def test_rope_tables_shared_within_a_forward_only_for_the_same_positions():
    """``shared_tables``: one table per (rope parameters, positions tensor) inside a forward, equal
    to the uncached one; a positions tensor changed in place, or another tensor, gets its own."""
    from dsv4.config import RopeParams
    from dsv4.model.rope import cos_sin
    from dsv4.model.step import shared_tables

    params = RopeParams(dim=64, theta=10000.0)
    pos = torch.tensor([0, 5, 300, 70000])
    want = cos_sin(params, pos)
    with shared_tables():
        first = cos_sin(params, pos)
        assert cos_sin(params, pos)[0] is first[0]  # computed once
        assert all(torch.equal(a, b) for a, b in zip(first, want))
        other = cos_sin(params, pos.clone())
        assert other[0] is not first[0] and torch.equal(other[0], want[0])
        pos[0] = 9  # in place: a new version of the tensor
        again = cos_sin(params, pos)
        assert again[0] is not first[0] and torch.equal(again[0], cos_sin(params, torch.tensor([9, 5, 300, 70000]))[0])
    assert cos_sin(params, pos)[0] is not cos_sin(params, pos)[0]  # no caching outside a forward


def test_op_path_with_torch_backends_equals_the_dequantized_model(tiny_ckpt):
    """The fast path's structure on CPU: weights kept in their checkpoint formats and consumed by
    the registered ops (their torch backends here; on the GPU the Triton ones), including the
    grouped output projection in one ``fp8_linear(groups=g)`` call, gives the dequantized oracle's
    logits up to fp32 summation order (the experts are stacked and summed in another order)."""
    from dsv4.model.model import ReferenceModel
    from dsv4.model.opset import WEIGHT_OPS, OpSet
    from dsv4.ops.registry import resolve

    ops = OpSet({op: resolve(op, force={op: "torch"})[1] for op in WEIGHT_OPS})
    fast, oracle = ReferenceModel(tiny_ckpt, ops=ops), ReferenceModel(tiny_ckpt)
    assert fast.cfg.o_groups > 1 and not isinstance(fast.blocks[0].attn.wo_a, torch.Tensor)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(5))
    got, want = fast.prefill(ids)[0], oracle.prefill(ids)[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_step_position_tables_are_shared_within_one_forward_only():
    """``Step.phase`` / ``Step.visible`` / ``Step.all_visible`` are computed once per forward
    (``shared_tables``) and ratio, recomputed when the positions change in place or are replaced, and never
    kept from one forward to the next: a CUDA graph captured after two uncaptured forwards on the same step
    must compute them inside the capture."""
    from dsv4.model.step import Step, shared_tables

    s = Step([], torch.arange(10))
    with shared_tables():
        first = s.phase(4)
        assert s.phase(4) is first and first.tolist() == [p % 4 for p in range(10)]
        s.positions.add_(3)
        assert s.phase(4).tolist() == [(p + 3) % 4 for p in range(10)]
        assert s.visible(4).tolist() == [(p + 4) // 4 for p in range(10)]
        s.positions = torch.arange(5)
        assert s.visible(128).tolist() == [0] * 5 and s.phase(4).tolist() == [0, 1, 2, 3, 0]
    with shared_tables():
        again = s.phase(4)
    assert again is not first and s.phase(4) is not s.phase(4)  # a new forward, and outside any: fresh
    s.positions = torch.tensor([2, 3, 9, 0])
    with shared_tables():
        hca = s.all_visible(4, 3)  # an HCA layer's entries: 0..(p + 1) // 4 - 1, then -1
        assert hca.tolist() == [[-1, -1, -1], [0, -1, -1], [0, 1, -1], [-1, -1, -1]]
        assert s.all_visible(4, 3) is hca and s.all_visible(4, 2) is not hca  # once per (ratio, width)
