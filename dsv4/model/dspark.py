"""DSpark: the 0731 release's speculative drafter (a semi-autoregressive block drafter).

The checkpoint's ``mtp.0..S-1`` are S full SWA decoder blocks (layer indices ``num_hidden_layers
+ m``) plus heads:

- **context**: ``main_x = main_norm(main_proj(concat of the target's aux hidden states))``, where
  a target layer's aux hidden state is the stream mean of its mHC-post output, taken at
  ``dspark_target_layer_ids``. Each stage turns ``main_x`` into its context KV with its own
  ``wkv`` (vLLM stacks these as ``context_wkv_proj``), ``kv_norm`` and RoPE, and writes it into its
  own window cache at the positions of the verified tokens;
- **block**: one pass of the stages over the embeddings of ``[anchor, noise × (k − 1)]`` (the
  anchor is the last sampled token, at the position after the context) expanded to the hc
  streams; every block query attends to the stage's context KV at the ``sliding_window``
  positions before the block and to all the block's keys (``Attention._attend_block``);
  then the last stage's ``hc_head``, ``norm`` and the target's head. Row i predicts the token
  after block position i, so a block of k rows gives k drafts;
- **Markov head**: a low-rank bias from the previous token, ``markov_w2 · markov_w1[prev]``, added
  to row i's logits before its draft is picked (prev: the anchor for row 0, then each draft);
- **confidence head** (optional): ``sigmoid(proj([h_i ; markov_w1[prev]]))`` with ``h_i`` the
  row's ``hc_head`` output before the norm, the predicted chance that the draft is accepted.

Choices where the public sources leave a fact open (the most plausible reading of them):

- the number of stages is the count of ``compress_ratios`` entries past the main layers (3 in
  0731, whose ``num_nextn_predict_layers`` is 1); the stages are SWA-only with the main RoPE and
  bias-routed MoE (never hash-routed), like the MTP layer;
- the block has k = ``num_speculative_tokens`` rows, not ``dspark_block_size`` (non-causal
  attention makes each row depend on the block's length);
- the context window is the ``sliding_window`` positions before the anchor (DeepSeek's reference
  keeps a ring of ``window`` context entries per stage);
- the block's own KV is rounded like a cache entry (the reference quantizes it); the reference
  pass keeps it aside, the paged pass stores it at the block's positions (past the computed
  tokens: overwritten by the next context write before anything reads it);
- ``markov_w2`` is stored as the [V, r] weight of a linear from r to V (the loaders read it as an
  LM head of width r);
- the confidence head reads ``hc_head``'s output before the final norm, and a ``proj.bias`` is
  used when the checkpoint has one;
- a layer's stream mean is taken in the compute dtype.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import ModelConfig
from .linear import rows_linear
from .rope import cos_sin
from .step import Step


class DSparkDrafter:
    """The drafter's weights and its two passes; ``stages`` are the model's ``Block``s of ``mtp.m``."""

    def __init__(self, w, cfg: ModelConfig, ops, stages: list, act_quant: bool = False):
        if not stages:
            raise ValueError("a DSpark drafter needs at least one stage")
        self.cfg, self.ops, self.stages, self.act_quant = cfg, ops, stages, act_quant
        last = f"mtp.{len(stages) - 1}"
        self.main_proj, self.main_norm = w["mtp.0.main_proj.weight"], w["mtp.0.main_norm.weight"]
        self.hc = (w[f"{last}.hc_head_fn"], w[f"{last}.hc_head_base"], w[f"{last}.hc_head_scale"])
        self.norm = w[f"{last}.norm.weight"]
        self.markov_w1 = w[f"{last}.markov_head.markov_w1.weight"]
        self.markov_w2 = w[f"{last}.markov_head.markov_w2.weight"]
        self.confidence_w = w.get(f"{last}.confidence_head.proj.weight")
        self.confidence_b = w.get(f"{last}.confidence_head.proj.bias")
        self.target_layers = cfg.dspark_target_layer_ids
        self.noise_token_id = cfg.dspark_noise_token_id
        self.block_size = cfg.dspark_block_size

    @property
    def has_confidence(self) -> bool:
        return self.confidence_w is not None

    def context(self, aux: torch.Tensor, step: Step) -> None:
        """Write every stage's context KV for the rows ``aux`` [T, n_target·H] (the target's aux
        hidden states of the step's positions, in its chunks' order) into its window cache, through
        the step's backend (``Attention.store_kv``)."""
        cfg, ops = self.cfg, self.ops
        main_x = ops.rms_norm(ops.linear(aux, self.main_proj, self.act_quant), self.main_norm, cfg.rms_norm_eps)
        for st in self.stages:
            a = st.attn
            cos, sin = cos_sin(a.rope, step.positions)
            a.store_kv(step, ops.linear(main_x, a.wkv, self.act_quant), cos, sin)

    def block(self, ids: torch.Tensor, step: Step, embed, head) -> tuple[torch.Tensor, torch.Tensor]:
        """The stages over the draft blocks ``ids`` (each of the step's chunks one block at its
        positions; ``embed`` and ``head``: the target's): returns (logits [T, V] fp32 before the
        Markov bias, the ``hc_head`` outputs [T, H])."""
        cfg, ops = self.cfg, self.ops
        step = replace(step, block=_block_length(step))
        x = embed(ids)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = self.stages[0].attn_pre(streams)
        for i, st in enumerate(self.stages):
            nxt = self.stages[i + 1] if i + 1 < len(self.stages) else None
            streams, pre = st.run(streams, pre, step, ids, nxt)
        h = ops.hc_head(streams, *self.hc, cfg.hc_eps, cfg.rms_norm_eps)
        return head(ops.rms_norm(h, self.norm, cfg.rms_norm_eps)), h

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit bias [n, V] fp32, the previous tokens' Markov embeddings [n, r]) of ``prev``."""
        e = self.markov_w1[prev]
        return self.ops.linear(e, self.markov_w2).float(), e

    def confidence(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
        """Per row, the confidence head's acceptance probability (None without the head)."""
        if self.confidence_w is None:
            return None
        z = rows_linear(torch.cat([h.float(), e.float()], dim=-1), self.confidence_w.float())  # batch-invariant
        if self.confidence_b is not None:
            z = z + self.confidence_b.float()
        return torch.sigmoid(z.squeeze(-1))


def _block_length(step: Step) -> int:
    """The length every DSpark draft block of a pass shares (the paged pass reads their windows by it)."""
    lengths = {c.length for c in step.chunks}
    if len(lengths) != 1:
        raise ValueError(f"DSpark draft blocks of one pass must have one length, got {sorted(lengths)}")
    return lengths.pop()
