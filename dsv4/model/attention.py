"""Attention of one layer: sliding window + (CSA: compressor + Lightning Indexer | HCA: compressor).

Token-parallel parts (projections, norms, RoPE, output projection) run over the whole batch; the
sequence-dependent parts (window, compressor, indexer, the sparse softmax) run in the backend the
step's metadata picks (``BACKENDS[step.kind]``, ``dsv4.model.step``): the reference's runs them per
sequence chunk against its :class:`~dsv4.model.cache.SequenceCache` (``Attention._attend``); the
paged one for all tokens at once over the pages (``dsv4.model.paged_attention``), where the window
KV's RMSNorm, RoPE and cache insert are one op (``kv_norm_rope_insert``; unfused while validation
hooks are installed, as they check the KV).
The window and the selected compressed entries form **one** softmax, with the per-head sink as an
extra zero-valued key.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import LayerType, ModelConfig
from ..formats import OCP, fake_quant_fp8_pow2
from .linear import stable_topk
from .paged_attention import PagedAttention
from .rope import cos_sin
from .step import SeqChunk, Step
from .weights import stack_fp8_rows


def _stack_rows(w, key_a: str, key_b: str):
    """(a, b, [a; b]) for two plain weights of one shape: a and b become row views of the stacked
    tensor (also in the weight store, so the model holds one copy), which the fast path multiplies
    in one launch. (a, b, None) when they are not plain tensors of one shape, dtype and device."""
    a, b = w[key_a], w[key_b]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.dim() == 2):
        return a, b, None
    both = torch.cat([a, b])
    a, b = both[: a.shape[0]], both[a.shape[0]:]
    store = getattr(w, "t", None)
    if isinstance(store, dict):
        store[key_a], store[key_b] = a, b
    return a, b, both


class Compressor:
    """Learned pooling of ``ratio`` tokens into one entry (overlapping 2·ratio rows when ratio=4).

    Every token's state row ``[kv | score + ape[p % ratio]]`` (fp32) goes to the cache; an entry
    is emitted at each block end (p+1) % ratio == 0 from the rows the cache still holds, so any
    chunking of the prompt gives the same entries.
    """

    def __init__(self, w, prefix: str, cfg: ModelConfig, ratio: int, dim: int, kind: str, layer: int, ops):
        self.ops = ops
        self.wkv, self.wgate, self.w_state = _stack_rows(w, f"{prefix}.wkv.weight", f"{prefix}.wgate.weight")
        self.ape = w[f"{prefix}.ape"]
        self.norm = w[f"{prefix}.norm.weight"]
        self.cfg, self.ratio, self.dim, self.kind, self.layer = cfg, ratio, dim, kind, layer
        self.overlap = ratio == 4

    def state_rows(self, x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """[kv | score + ape[phase]] in fp32, phase = position % ratio. ``[wkv; wgate]`` is one GEMM (one
        launch on the fast path), each half reduced over K as its own weight would be: the same bits as
        two calls; the ape rows are added in place (``add_`` on the view: no write-back copy)."""
        ops = self.ops
        if self.w_state is not None:
            rows = self.raw_rows(x).float()
            rows[:, self.wkv.shape[0]:].add_(self.ape[phase])
            return rows
        kv = ops.linear(x, self.wkv).float()
        score = ops.linear(x, self.wgate).float() + self.ape[phase]
        return torch.cat([kv, score], dim=-1)

    def raw_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked [wkv; wgate] GEMM's output in the weight dtype (``w_state`` only): the state rows before
        the fp32 conversion and the ape add, which a decode step's ``compressor_pool_insert`` does itself."""
        return self.ops.dense_linear(x.to(self.w_state.dtype), self.w_state, chunk_rows=self.wkv.shape[0])

    def run(self, x: torch.Tensor, chunk: SeqChunk) -> None:
        """Save state rows of the chunk and emit every entry whose block closes inside it."""
        pos = chunk.positions
        cache = chunk.cache
        cache.write_state(self.layer, self.kind, pos, self.state_rows(x, pos % self.ratio))
        r, d = self.ratio, self.dim
        first_block = chunk.start // r
        last_block = (chunk.start + chunk.length) // r  # exclusive: blocks fully closed by the chunk end
        if last_block <= first_block:
            return
        dev = x.device
        blocks = torch.arange(first_block, last_block, device=dev)
        width = self.wkv.shape[0]  # coff·d
        cur_pos = blocks[:, None] * r + torch.arange(r, device=dev)[None, :]  # [nb, r]
        cur = cache.read_state(self.layer, self.kind, cur_pos.flatten()).view(len(blocks), r, 2 * width)
        kv, score = cur[..., :width], cur[..., width:]
        if self.overlap:
            # rows of block b-1 contribute their first half (Ca), rows of block b the second (Cb)
            prev_kv = torch.zeros(len(blocks), r, d, device=dev)
            prev_sc = torch.full((len(blocks), r, d), float("-inf"), device=dev)
            has_prev = blocks > 0
            if bool(has_prev.any()):
                pp = (cur_pos[has_prev] - r).flatten()
                prev = cache.read_state(self.layer, self.kind, pp).view(-1, r, 2 * width)
                prev_kv[has_prev] = prev[..., :d]
                prev_sc[has_prev] = prev[..., width: width + d]
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            score = torch.cat([prev_sc, score[..., d:]], dim=1)
        weights = torch.softmax(score.double(), dim=1).float()  # per-channel softmax over rows
        pooled = (kv * weights).sum(dim=1)
        normed = self.ops.rms_norm(pooled, self.norm, self.cfg.rms_norm_eps)
        cos, sin = cos_sin(self.cfg.rope_compress, blocks * r)
        entries = self.ops.apply_rope(normed, cos, sin)
        cache.write_compressed(self.layer, self.kind, blocks, entries)


class Attention:
    def __init__(self, w, layer: int, cfg: ModelConfig, ops, prefix: str | None = None, act_quant: bool = False,
                 tp=None):
        p = prefix or f"layers.{layer}.attn"
        self.cfg, self.layer, self.act_quant, self.ops = cfg, layer, act_quant, ops
        self.type = cfg.layer_type(layer)
        self.ratio = cfg.compress_ratio(layer)
        self.rope = cfg.rope(layer)
        # wq_a and wkv both read x: on the FP8 fast path one stacked weight, one launch (``stack_fp8_rows``)
        self.wq_a, self.wkv, self.wq_a_kv = stack_fp8_rows(w, f"{p}.wq_a.weight", f"{p}.wkv.weight")
        self.q_norm, self.wq_b, self.kv_norm = w[f"{p}.q_norm.weight"], w[f"{p}.wq_b.weight"], w[f"{p}.kv_norm.weight"]
        self.wo_a, self.wo_b = w[f"{p}.wo_a.weight"], w[f"{p}.wo_b.weight"]
        self.sink = w[f"{p}.attn_sink"]
        self.compressor = None
        if self.type != LayerType.SWA:
            self.compressor = Compressor(w, f"{p}.compressor", cfg, self.ratio, cfg.head_dim, "kv", layer, ops)
        if self.type == LayerType.CSA:
            self.idx_wq_b = w[f"{p}.indexer.wq_b.weight"]
            self.idx_weights = w[f"{p}.indexer.weights_proj.weight"]
            self.idx_compressor = Compressor(w, f"{p}.indexer.compressor", cfg, 4, cfg.index_head_dim, "index",
                                             layer, ops)
        self.hooks = None  # optional callback(name, tensor) for --validate style checks
        self.tp = tp  # tensor parallelism (dsv4/parallel): this rank holds a share of the heads and groups

    def _check(self, name, t):
        if self.hooks is not None:
            self.hooks(f"layers.{self.layer}.attn.{name}", t)

    # ---- indexer -------------------------------------------------------------------------
    def indexer_topk(self, x: torch.Tensor, qr: torch.Tensor, chunk: SeqChunk, n_entries: int) -> torch.Tensor:
        """Per query: indices of the top-k visible compressed entries (-1 = none), [t, k]."""
        cfg, ops = self.cfg, self.ops
        pos = chunk.positions
        t = chunk.length
        q = ops.linear(qr, self.idx_wq_b, self.act_quant).view(t, cfg.index_n_heads, cfg.index_head_dim)
        cos, sin = cos_sin(cfg.rope_compress, pos)
        q = ops.apply_rope(q, cos, sin).float()
        weights = ops.linear(x, self.idx_weights).float() * (cfg.index_n_heads ** -0.5) * (cfg.index_head_dim ** -0.5)
        if chunk.cache.numerics.quantized:
            # FP8 q with one power-of-two scale per (token, head); the scale folds into the weights
            q = fake_quant_fp8_pow2(q.to(torch.bfloat16).float(), cfg.index_head_dim, chunk.cache.numerics.fmt)
        ar = torch.arange(n_entries, device=x.device)
        k = chunk.cache.read_compressed(self.layer, "index", ar).float()
        kpad = (-n_entries) % 64  # fixed-width columns: a score never depends on how many entries exist
        if kpad:
            k = torch.cat([k, k.new_zeros(kpad, k.shape[1])])
        scores = ops.linear(q.reshape(t * cfg.index_n_heads, -1), k)[:, :n_entries]
        scores = scores.view(t, cfg.index_n_heads, n_entries)
        logits = (scores.relu() * weights[:, :, None]).sum(dim=1)  # [t, s]
        visible = ar[None, :] < ((pos + 1) // 4)[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        kk = min(cfg.index_topk, n_entries)
        idx = stable_topk(logits, kk)
        ok = torch.gather(visible, 1, idx)
        return torch.where(ok, idx, torch.full_like(idx, -1))

    # ---- forward -------------------------------------------------------------------------
    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qr, kv_raw): the query latent after q_norm (the indexer's input too) and the raw wkv projection."""
        cfg, ops = self.cfg, self.ops
        if self.wq_a_kv is not None:  # one GEMM; its column halves go on as views (their readers take a row stride)
            q_lat, kv_raw = ops.linear(x, self.wq_a_kv, self.act_quant).split(
                [self.wq_a.shape[0], self.wkv.shape[0]], dim=-1)
        else:
            q_lat, kv_raw = ops.linear(x, self.wq_a, self.act_quant), ops.linear(x, self.wkv, self.act_quant)
        return ops.rms_norm(q_lat, self.q_norm, cfg.rms_norm_eps), kv_raw

    def queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The heads' queries [T, h, d] from the latent: wq_b, then each head's unit RMSNorm and RoPE."""
        cfg, ops = self.cfg, self.ops
        nh = self.wq_b.shape[0] // cfg.head_dim  # query heads held here: all, or this rank's share under TP
        q = ops.linear(qr, self.wq_b, self.act_quant).view(qr.shape[0], nh, cfg.head_dim)
        q = ops.unit_norm_rope(q, cos, sin, cfg.rms_norm_eps)
        self._check("q", q)
        return q

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """The layer over the step's tokens; ``step`` (``dsv4.model.step``) picks the backend, which
        also orders the projections (``latent``, ``queries``) among its sequence work."""
        cfg, ops = self.cfg, self.ops
        T = x.shape[0]
        cos, sin = cos_sin(self.rope, step.positions)
        out = BACKENDS[step.kind].attend(self, step, x, cos, sin)
        o = ops.apply_rope(out, cos, sin, inverse=True, in_place=self.hooks is None)  # hooks may keep `out`
        r = cfg.o_lora_rank
        g = self.wo_a.shape[0] // r  # output groups held here (TP: this rank's whole groups)
        o = o.view(T, g, -1)
        grouped_op = not isinstance(self.wo_a, torch.Tensor) and self.wo_a.op is not None
        if self.act_quant and not grouped_op:
            o = fake_quant_fp8_pow2(o.float(), 128, OCP).to(o.dtype)
        if isinstance(self.wo_a, torch.Tensor):
            z = torch.cat([ops.linear(o[:, i], w_i) for i, w_i in enumerate(self.wo_a.view(g, r, -1))], dim=-1)
        elif grouped_op:  # the fp8_linear op: all groups in one launch (with act_quant it rounds o itself)
            quant = {"act_quant": True, "act_fmt": OCP} if self.act_quant else {}
            z = self.wo_a.op(o.reshape(T, -1), self.wo_a.weight, self.wo_a.scale, groups=g, **quant)
        else:
            z = torch.cat([ops.linear(o[:, i], self.wo_a.rows(i * r, (i + 1) * r)) for i in range(g)], dim=-1)
        y = ops.linear(z, self.wo_b, self.act_quant)
        return y if self.tp is None else self.tp.all_reduce(y)  # TP: wo_b is row-parallel, sum the ranks

    def store_kv(self, step: Step, kv_raw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Write the window KV of the step's tokens from ``kv_raw`` (the wkv projection) and attend
        to nothing: a DSpark stage's context KV."""
        BACKENDS[step.kind].store_kv(self, step, kv_raw, cos, sin)

    def window_kv(self, kv_raw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The window KV as the layer stores it: ``kv_raw`` normed and roped."""
        return self.ops.apply_rope(self.ops.rms_norm(kv_raw, self.kv_norm, self.cfg.rms_norm_eps), cos, sin)

    def _attend(self, x, qr, q, kv, c: SeqChunk) -> torch.Tensor:
        cfg = self.cfg
        cache = c.cache
        pos = c.positions
        dev = x.device
        cache.write_kv(self.layer, pos, kv)
        w = cfg.sliding_window
        win_start = max(0, c.start - w + 1)
        win_keys = cache.read_kv(self.layer, torch.arange(win_start, c.start + c.length, device=dev))
        self._check("k_window", win_keys)
        n = 0
        comp_idx = torch.empty(c.length, 0, dtype=torch.long, device=dev)
        table = win_keys
        if self.compressor is not None:
            self.compressor.run(x, c)
            n = (c.start + c.length) // self.ratio  # entries complete up to the chunk end
            if self.type == LayerType.CSA:
                self.idx_compressor.run(x, c)
            if n > 0:
                comp = cache.read_compressed(self.layer, "kv", torch.arange(n, device=dev))
                self._check("k_compressed", comp)
                if self.type == LayerType.CSA:
                    sel = self.indexer_topk(x, qr, c, n)
                    comp_idx = torch.sort(torch.where(sel >= 0, sel, n), dim=1).values  # ascending, invalid last
                    comp_idx = torch.where(comp_idx >= n, -1, comp_idx)
                else:
                    ar = torch.arange(n, device=dev)
                    comp_idx = torch.where(ar[None, :] < ((pos + 1) // self.ratio)[:, None], ar[None, :], -1)
                table = torch.cat([comp.to(win_keys.dtype), win_keys], dim=0)
        # window keys of query p: positions (p-w, p] → table rows n + pos - win_start
        offs = torch.arange(w, device=dev)
        wpos = pos[:, None] - (w - 1) + offs[None, :]
        win_idx = torch.where(wpos >= 0, n + wpos - win_start, -1)
        idx = left_align(torch.cat([comp_idx, win_idx], dim=1))
        return sparse_attention(q, table, idx, self.sink, cfg.head_dim**-0.5, self._check)

    def _attend_block(self, x, qr, q, kv, c: SeqChunk) -> torch.Tensor:
        """A DSpark draft block at positions ``c.start ..``: every query sees the layer's context KV
        at the ``sliding_window`` positions before the block (read from the cache, where the
        proposer wrote it) and every key of the block, its own and later ones included (non-causal
        inside the block). The block's KV is rounded as the cache would store it but not written:
        the cache keeps context KV of verified positions only."""
        cache, dev = c.cache, x.device
        ctx = cache.read_kv(self.layer, torch.arange(max(0, c.start - self.cfg.sliding_window), c.start, device=dev))
        table = torch.cat([ctx.to(kv.dtype), cache.numerics.kv(kv)], dim=0)
        idx = torch.arange(table.shape[0], device=dev).expand(c.length, -1)
        return sparse_attention(q, table, idx, self.sink, self.cfg.head_dim**-0.5, self._check)


class AttentionBackend(Protocol):
    """The sequence-dependent part of a layer's attention for a step: one per metadata kind."""

    def attend(self, attn: Attention, step: Step, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Every token's attention output [T, h, d] (before the inverse rope): the queries from
        ``attn.latent(x)`` and ``attn.queries``, the window KV (from the latent's ``kv_raw`` with the
        main rope's ``cos``/``sin``) stored on the way."""

    def store_kv(self, attn: Attention, step: Step, kv_raw: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        """Store every token's window KV, attending to nothing."""


class ReferenceAttention:
    """The oracle's backend: each chunk through its own sequence cache, ``Attention._attend`` (a
    DSpark draft block's ``_attend_block``)."""

    def attend(self, attn, step, x, cos, sin):
        qr, kv_raw = attn.latent(x)
        q = attn.queries(qr, cos, sin)
        kv = attn.window_kv(kv_raw, cos, sin)
        out = torch.empty_like(q)
        one = attn._attend_block if step.block else attn._attend
        for c in step.chunks:
            sl = slice(c.offset, c.offset + c.length)
            out[sl] = one(x[sl], qr[sl], q[sl], kv[sl], c)
        return out

    def store_kv(self, attn, step, kv_raw, cos, sin):
        kv = attn.window_kv(kv_raw, cos, sin)
        for c in step.chunks:
            sl = slice(c.offset, c.offset + c.length)
            c.cache.write_kv(attn.layer, step.positions[sl], kv[sl])


BACKENDS: dict[str, AttentionBackend] = {"reference": ReferenceAttention(), "paged": PagedAttention()}


def left_align(idx: torch.Tensor) -> torch.Tensor:
    """Move the valid (≥0) entries of each row to the front, keeping their order."""
    order = torch.sort((idx < 0).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(idx, 1, order)


KEY_BLOCK = 64  # keys are reduced in fixed blocks so a query's result never depends on its neighbours


def sparse_attention(
    q: torch.Tensor,
    table: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    check=None,
    query_block: int = 64,
) -> torch.Tensor:
    """Softmax over the keys each query lists, plus a per-head sink logit; K = V (shared-KV MQA).

    q [t, h, d]; table [n, d] holds the keys; idx [t, L] lists each query's keys left-aligned
    (-1 = none). The sink is not scaled and only adds ``exp(sink)`` to the denominator. The
    computation is batch-invariant: per query the same ops run on the same operands whatever
    else is in the batch (sink first, fixed 64-key reduction blocks, trailing padding only).
    """
    t, h, d = q.shape
    L = idx.shape[1]
    pad = (-L) % KEY_BLOCK
    if pad:
        idx = torch.cat([idx, idx.new_full((t, pad), -1)], dim=1)
        L += pad
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    sink_col = sink.float()[None, :, None]
    n = table.shape[0]
    tf = torch.cat([table.float(), table.new_zeros(1, d, dtype=torch.float32)])  # row n: the keys of -1
    for s in range(0, t, query_block):
        ids = idx[s : s + query_block]
        b = ids.shape[0]
        valid = ids >= 0
        # a row gather (embedding) copies the same values 3-6x faster on CPU than 2-D advanced indexing
        keys = torch.nn.functional.embedding(torch.where(valid, ids, n), tf)  # [b, L, d]
        logits = torch.bmm(q[s : s + b].float(), keys.transpose(1, 2)) * scale  # [b, h, L]
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        full = torch.cat([sink_col.expand(b, h, 1), logits], dim=-1).double()
        probs = torch.softmax(full, dim=-1)[..., 1:].float()
        if check is not None:
            check("logits", logits.masked_fill(~valid[:, None, :], 0.0))
            check("probs", probs)
        acc = torch.zeros(b, h, d, dtype=torch.float32, device=q.device)
        for k0 in range(0, L, KEY_BLOCK):
            if not bool(valid[:, k0].any()):
                break  # left-aligned: nothing valid from here on in this query block
            acc += torch.bmm(probs[..., k0 : k0 + KEY_BLOCK], keys[:, k0 : k0 + KEY_BLOCK])
        out[s : s + b] = acc
    return out.to(q.dtype)
