"""The reference DeepSeek-V4 forward (the oracle every fast path is checked against).

embed → 4 mHC streams → per layer [mHC-pre → attn_norm → attention → mHC-post → mHC-pre → ffn_norm → MoE →
mHC-post] → hc_head → norm → head. Each post but the last is computed together with the pre that follows it
(the ``mhc_post_pre`` op: attention post + MoE pre, MoE post + the next layer's attention pre), which
the fast path runs as one fused kernel; a pre also applies the sub-layer's RMSNorm (its ``norm`` argument),
the only reader of the collapsed streams, which the fast path does in the same launch. The MTP block
predicts one token further from the pre-hc_head streams. Every building block is called through the op set the
model was built with (``dsv4.model.opset``): without kernels, plain torch — the oracle.
A batch is a list of sequence chunks (:class:`~dsv4.model.step.SeqChunk`) concatenated along the
token axis; each chunk carries its own cache, so prefill, decode and chunked prefill are the same
call. The attention layers read the forward's metadata, a :class:`~dsv4.model.step.Step` (a list of
chunks stands for the reference's) or a ``PagedStep`` (the batched attention over the paged cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from .attention import Attention
from .cache import CacheNumerics, DenseSequenceCache, advance_all
from .dspark import DSparkDrafter
from .moe import MoE
from .opset import OpSet, reference_ops
from .step import SeqChunk, Step, shared_tables
from .weights import ModelWeights


class Block:
    """One decoder block; ``prefix`` is 'layers.N' or 'mtp.M'; ``tp`` / ``ep``: the model's groups."""

    def __init__(self, w: ModelWeights, prefix: str, layer: int, cfg: ModelConfig, act_quant: bool, ops: OpSet,
                 tp=None, ep=None):
        self.cfg, self.layer, self.prefix, self.ops = cfg, layer, prefix, ops
        self.attn_norm, self.ffn_norm = w[f"{prefix}.attn_norm.weight"], w[f"{prefix}.ffn_norm.weight"]
        self.hc_attn = (w[f"{prefix}.hc_attn_fn"], w[f"{prefix}.hc_attn_base"], w[f"{prefix}.hc_attn_scale"])
        self.hc_ffn = (w[f"{prefix}.hc_ffn_fn"], w[f"{prefix}.hc_ffn_base"], w[f"{prefix}.hc_ffn_scale"])
        self.attn = Attention(w, layer, cfg, ops, prefix=f"{prefix}.attn", act_quant=act_quant, tp=tp)
        self.moe = MoE(w, f"{prefix}.ffn", cfg, cfg.is_hash_layer(layer), act_quant, ops, tp=tp, ep=ep)

    def attn_pre(self, streams: torch.Tensor):
        """The attention's mHC pre: (the attention's input, i.e. the collapsed streams after attn_norm, post,
        comb) of ``streams``."""
        c = self.cfg
        return self.ops.mhc_pre(streams, *self.hc_attn, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                                self.attn_norm)

    def run(self, streams: torch.Tensor, pre, step: Step, token_ids: torch.Tensor,
            next_block: "Block | None" = None):
        """The block on ``streams`` whose attention pre ``pre`` (= ``attn_pre(streams)``) is known.

        Returns (new streams, ``next_block.attn_pre(new streams)`` or None): with a next block the
        MoE's post is fused with that block's attention pre, as the attention's post is with the
        MoE's pre."""
        c, ops = self.cfg, self.ops
        hc = (c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        x, post, comb = pre  # x: the attention's input (the collapsed streams after attn_norm)
        a = self.attn.forward(x, step)
        streams, x, post, comb = ops.mhc_post_pre(streams, a, post, comb, *self.hc_ffn, *hc, self.ffn_norm)
        f = self.moe.forward(x, token_ids)
        if next_block is None:
            return ops.mhc_post(streams, f, post, comb), None
        streams, x, post, comb = ops.mhc_post_pre(streams, f, post, comb, *next_block.hc_attn, *hc,
                                                  next_block.attn_norm)
        return streams, (x, post, comb)

    def forward(self, streams: torch.Tensor, step: Step, token_ids: torch.Tensor) -> torch.Tensor:
        """The whole block (its own attention pre, a plain final post): streams → new streams."""
        return self.run(streams, self.attn_pre(streams), step, token_ids)[0]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [T, vocab] fp32 (only rows asked for)
    streams: torch.Tensor  # pre-hc_head residual streams [T, n, H] (MTP input)
    aux: torch.Tensor | None = None  # the aux_layers' stream means, concatenated [T, n_aux·H] (DSpark input)


class ReferenceModel:
    """Plain-PyTorch DeepSeek-V4. ``dtype`` is the compute dtype (fp32 for parity, bf16 like the release)."""

    def __init__(self, model_dir: str | Path | ModelWeights, dtype: torch.dtype = torch.float32, device="cpu",
                 numerics: CacheNumerics | None = None, act_quant: bool = False, progress: bool = False,
                 ops: OpSet | None = None, tp=None, ep=None):
        """``numerics``: what the caches round to (the engine's, handed down; default the release's
        ``fp8_ds_mla`` in OCP bytes): the dense caches of ``new_cache`` apply it. ``ops``: the op set
        (``dsv4.ops.resolve_op_set``; default the oracle's, plain torch); with weight ops, weights stay
        in their checkpoint formats and those ops consume them (the GPU path). ``tp``: tensor
        parallelism (a ``dsv4.parallel.group.TPGroup``): this rank loads only its shard and the sharded
        layers call its collectives; None is the single-process model. ``ep``: data-parallel attention
        with expert parallelism (a ``dsv4.parallel.expert.EPGroup``): this rank loads every weight but
        the other ranks' routed experts, and its MoE layers exchange tokens with the other ranks. Both:
        tensor parallelism inside a data-parallel rank (``ep.tp`` is ``tp``): the experts split over
        every process, the rest over the rank's tensor-parallel group."""
        if tp is not None and ep is not None and getattr(ep, "tp", None) is not tp:
            raise ValueError("a model both tensor- and expert-parallel (tensor parallelism inside a data-parallel "
                             "rank) needs the expert group made for its tensor-parallel group (ep.tp is tp)")
        self.ops = ops = ops or reference_ops()
        if isinstance(model_dir, ModelWeights):
            self.w = model_dir
        else:
            self.w = ModelWeights(model_dir, dtype, device, progress, keep_quantized=ops.quantized_weights,
                                  fp8_linear=ops.fp8_linear, shard=ep or tp)
        self.cfg: ModelConfig = self.w.config
        self.dtype, self.device = self.w.dtype, self.w.device
        self.numerics = numerics or CacheNumerics()
        cfg = self.cfg
        self.blocks = [Block(self.w, f"layers.{i}", i, cfg, act_quant, ops, tp, ep)
                       for i in range(cfg.num_hidden_layers)]
        self.mtp = [Block(self.w, f"mtp.{m}", cfg.num_hidden_layers + m, cfg, act_quant, ops, tp, ep)
                    for m in range(cfg.num_mtp_layers + cfg.num_dspark_stages)]
        self.dspark = DSparkDrafter(self.w, cfg, ops, self.mtp, act_quant) if cfg.is_dspark else None
        self.embed, self.head, self.norm = self.w["embed.weight"], self.w["head.weight"], self.w["norm.weight"]
        self.hc_head_w = (self.w["hc_head_fn"], self.w["hc_head_base"], self.w["hc_head_scale"])
        self.tp, self.ep = tp, ep
        for group in (tp, ep):
            if group is not None:
                group.check(cfg)

    def set_hooks(self, fn) -> None:
        """Install a callback(name, tensor) on every attention (used by finite checks)."""
        for b in self.blocks + self.mtp:
            b.attn.hooks = fn

    def new_cache(self) -> DenseSequenceCache:
        return DenseSequenceCache(self.cfg, self.numerics)

    def _step(self, step: Step | list[SeqChunk]) -> Step:
        """The forward's metadata: ``step``, or for a list of chunks the reference's (``Step.of``)."""
        return step if isinstance(step, Step) else Step.of(step, self.device)

    # ---- main forward --------------------------------------------------------------------
    def hidden(self, token_ids: torch.Tensor, step: Step | list[SeqChunk], hook=None,
               advance: bool = True) -> torch.Tensor:
        """Run the decoder stack over the step (``dsv4.model.step``: its kind picks the attention
        backend); returns the pre-hc_head streams [T, n, H]. ``advance=False`` leaves the caches'
        bookkeeping to the caller (a CUDA-graph replay)."""
        cfg = self.cfg
        step = self._step(step)
        if step.positions.shape[0] != token_ids.shape[0]:
            raise ValueError(f"the step covers {step.positions.shape[0]} tokens but {token_ids.shape[0]} token "
                             "ids were given")
        x = self._embed(token_ids)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = self.blocks[0].attn_pre(streams) if self.blocks else None
        for i, b in enumerate(self.blocks):  # each block's last post fused with the next one's pre
            nxt = self.blocks[i + 1] if i + 1 < len(self.blocks) else None
            streams, pre = b.run(streams, pre, step, token_ids, nxt)
            if hook is not None:
                hook(f"layers.{b.layer}", streams)
        if advance:
            advance_all((c.cache, c.length) for c in step.chunks)
        return streams

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # vocab-parallel: masked lookup of this rank's rows + all-reduce
            return self.tp.embed(self.embed, ids).to(self.dtype)
        return self.embed[ids].to(self.dtype)

    def logits_from_streams(self, streams: torch.Tensor, hc=None, norm=None) -> torch.Tensor:
        cfg = self.cfg
        ops = self.ops
        fn, base, scale = hc or self.hc_head_w
        h = ops.hc_head(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)
        h = ops.rms_norm(h, self.norm if norm is None else norm, cfg.rms_norm_eps)
        logits = ops.linear(h, self.head).float()
        if self.tp is not None:  # vocab-parallel head: every rank's columns, gathered
            logits = self.tp.gather_vocab(logits, cfg.vocab_size)
        return logits

    def forward(self, token_ids: torch.Tensor, step: Step | list[SeqChunk], logits_rows: torch.Tensor | None = None,
                hook=None, advance: bool = True, aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """``aux_layers``: main layers whose outputs' stream means the output carries (``aux``, in
        that order), the DSpark drafter's context input."""
        taps: dict[int, torch.Tensor] = {}
        if aux_layers:
            want, inner = {f"layers.{i}": i for i in aux_layers}, hook

            def hook(name, streams):
                if name in want:
                    taps[want[name]] = streams.mean(dim=1)
                if inner is not None:
                    inner(name, streams)

        with shared_tables():
            streams = self.hidden(token_ids, step, hook, advance)
            aux = torch.cat([taps[i] for i in aux_layers], dim=-1) if aux_layers else None
            rows = streams if logits_rows is None else streams[logits_rows]
            if rows.shape[0] == 0:  # e.g. a step of partial prefills only: the cache is filled, no logits
                return ForwardOutput(torch.empty(0, self.cfg.vocab_size, device=self.device), streams, aux)
            return ForwardOutput(self.logits_from_streams(rows), streams, aux)

    # ---- MTP -----------------------------------------------------------------------------
    def mtp_forward(self, next_ids: torch.Tensor, streams: torch.Tensor, step: Step | list[SeqChunk], m: int = 0,
                    logits_rows: torch.Tensor | None = None) -> ForwardOutput:
        """Draft logits for token i+2 from the streams at row i and the token at i+1.

        ``streams``: the target's pre-hc_head streams (or, for a further draft, this layer's own
        output streams, re-fed as vLLM does); ``step`` gives the rows' positions and the MTP layer's
        window cache (written at those positions; the target's caches are not touched and no view
        advances); ``logits_rows``: the rows whose logits are needed (None: all). Returns the logits
        and the layer's output streams (for the next draft)."""
        cfg = self.cfg
        p = f"mtp.{m}"
        step = self._step(step)
        pos = step.positions
        ops = self.ops
        e = ops.rms_norm(self._embed(next_ids), self.w[f"{p}.enorm.weight"], cfg.rms_norm_eps)
        e = torch.where((pos == 0)[:, None], torch.zeros_like(e), e)
        h = ops.rms_norm(streams, self.w[f"{p}.hnorm.weight"], cfg.rms_norm_eps)
        s = ops.linear(h, self.w[f"{p}.h_proj.weight"]) + ops.linear(e, self.w[f"{p}.e_proj.weight"]).unsqueeze(1)
        with shared_tables():
            s = self.mtp[m].forward(s.to(self.dtype), step, next_ids)
            rows = s if logits_rows is None else s[logits_rows]
            hc = (self.w[f"{p}.hc_head_fn"], self.w[f"{p}.hc_head_base"], self.w[f"{p}.hc_head_scale"])
            if rows.shape[0] == 0:
                return ForwardOutput(torch.empty(0, cfg.vocab_size, device=self.device), s)
            return ForwardOutput(self.logits_from_streams(rows, hc=hc, norm=self.w[f"{p}.norm.weight"]), s)

    # ---- DSpark ---------------------------------------------------------------------------
    def dspark_context(self, aux: torch.Tensor, step: Step | list[SeqChunk]) -> None:
        """Write the DSpark stages' context KV of the step's positions (``aux``: the target's aux
        hidden states there, ``forward(..., aux_layers=cfg.dspark_target_layer_ids)``) into the
        chunks' caches or the pages; nothing else is written and no view advances."""
        self.dspark.context(aux, self._step(step))

    def dspark_block(self, ids: torch.Tensor, step: Step | list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One DSpark pass over draft blocks (each chunk: one block ``[anchor, noise …]`` at the
        positions after its context): (logits [T, V] fp32 without the Markov bias, hc_head outputs)."""
        with shared_tables():
            return self.dspark.block(ids, self._step(step), self._embed,
                                     lambda x: self.ops.linear(x, self.head).float())

    # ---- conveniences for tests and tools -------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: list[int] | torch.Tensor, cache=None, chunk_sizes: list[int] | None = None):
        """Run a prompt through ``cache`` (split into ``chunk_sizes``); returns (logits [T, V], cache)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        cache = cache or self.new_cache()
        start0 = getattr(cache, "num_tokens", 0)
        sizes = chunk_sizes or [len(ids)]
        if sum(sizes) != len(ids):
            raise ValueError(f"chunk sizes {sizes} do not sum to {len(ids)}")
        outs, off = [], 0
        for n in sizes:
            out = self.forward(ids[off : off + n], [SeqChunk(cache, start0 + off, n)])
            outs.append(out.logits)
            off += n
        return torch.cat(outs), cache

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, cache=None) -> tuple[list[int], torch.Tensor]:
        """Greedy decode; returns (new token ids, logits of each step [n, V])."""
        logits, cache = self.prefill(prompt, cache)
        last = logits[-1]
        out, steps = [], [last]
        for i in range(max_new_tokens):
            tok = int(torch.argmax(last))
            out.append(tok)
            if i == max_new_tokens - 1:
                break
            last = self.forward(torch.tensor([tok], device=self.device), [SeqChunk(cache, cache.num_tokens, 1)]).logits[
                -1
            ]
            steps.append(last)
        return out, torch.stack(steps)
