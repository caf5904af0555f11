"""Shared helpers of the speculative-decoding tests (MTP and DSpark): scripted drafts, runs by
request id, and the cache image every rollback test compares."""

from __future__ import annotations

import torch

from dsv4.engine.request import Drafts


class ScriptedDrafts:
    """After every step each request with drafts gets the known continuation instead, with draft
    ``calls % (k + 1)`` wrong (k + 1: all right). The drafter still runs — the eager proposer or the
    speculative graphs — so its cache is checked too."""

    def __init__(self, eng, truth: dict[str, list[int]], vocab: int):
        self.truth, self.vocab = truth, vocab
        self.num_speculative_tokens = eng.proposer.num_speculative_tokens
        self.calls: dict[str, int] = {}
        finish = eng._finish_step

        def scripted(schedule, touched):
            for sc in schedule:
                self._script(sc.req)
            return finish(schedule, touched)

        eng._finish_step = scripted

    def _script(self, req):
        if req.finished or not req.drafts or req.request_id not in self.truth:  # (unscripted: the drafter's)
            return
        k = self.num_speculative_tokens
        n = self.calls[req.request_id] = self.calls.get(req.request_id, -1) + 1
        toks = list(self.truth[req.request_id][len(req.output_token_ids):][: len(req.drafts)])
        wrong = n % (k + 1)
        if wrong < len(toks):
            toks[wrong] = (toks[wrong] + 1 + n) % self.vocab
        req.drafts = Drafts(toks, None)


def script(llm, truth):
    eng = llm.engine
    return ScriptedDrafts(eng, truth, eng.model_config.vocab_size)


def run(llm, prompts, params, ids=None):
    eng = llm.engine
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(prompt_token_ids=p, params=params, request_id=rid)
    return eng.run_to_completion(ids)


def record_step_drafts(eng) -> dict:
    """Wrap the engine's step end: after every step, each live request's drafts (tokens, confidences),
    keyed (id, tokens so far) — what the eager proposer and the speculative graphs are compared by."""
    drafts, finish = {}, eng._finish_step

    def recording(schedule, touched):
        for sc in schedule:
            r = sc.req
            if not r.finished:
                drafts[(r.request_id, r.num_tokens)] = (list(r.drafts.tokens), list(r.drafts.confidence or []))
        return finish(schedule, touched)

    eng._finish_step = recording
    return drafts


def cache_image(eng, req) -> dict:
    """Everything of ``req`` a later query can read, by kind (and each draft layer's window: the
    MTP layer's, or the DSpark stages')."""
    kvc, view, cfg = eng.kv_cache, eng.kv.view(req.alloc), eng.model_config
    nc = req.alloc.num_computed
    pos = torch.arange(max(0, nc - cfg.sliding_window + 1), nc)
    out = {f"window {layer}": view.read_kv(layer, pos) for layer in range(cfg.num_hidden_layers)}
    for layer in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_draft_layers):
        out[f"draft window {layer}"] = view.read_kv(layer, pos)
    for key in kvc.comp:
        n = nc // kvc.ratio[key]
        out[f"compressed {key}"] = view.read_compressed(*key, torch.arange(n)) if n else None
    for key, ring in kvc.ring.items():
        r, size = kvc.ratio[key], ring.shape[1]
        first = max(0, (nc // r) * r - (r if r == 4 else 0))
        out[f"state {key}"] = ring[req.alloc.slot][torch.arange(first, nc) % size].clone()
    for key, b in kvc.boundary.items():
        out[f"boundary {key}"] = [b[blk].clone() for blk in req.alloc.blocks[: nc // 256]]
    return out


def record_images(llm, images: dict, want: set | None = None):
    """Record ``cache_image`` of every live request at the end of each step, keyed (id, tokens)."""
    eng = llm.engine
    finish = eng._finish_step

    def recording(schedule, touched):
        for sc in schedule:
            req = sc.req
            key = (req.request_id, req.alloc.num_computed)
            if not req.finished and (want is None or key in want):
                images[key] = cache_image(eng, req)
        return finish(schedule, touched)

    eng._finish_step = recording


def images_equal(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(images_equal(x, y) for x, y in zip(a, b))
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def assert_images_match_a_run_without_speculation(base, seen: dict, prompts, params) -> None:
    """Re-run ``prompts`` on ``base`` (no speculation) recording the token counts ``seen`` has:
    every kind but the draft layers' windows must be equal, byte for byte."""
    again: dict = {}
    base.engine.kv.reset_prefix_cache()
    record_images(base, again, set(seen))
    run(base, prompts, params)
    assert set(again) == set(seen)
    for key in seen:
        a, b = seen[key], again[key]
        bad = [kind for kind in a if not kind.startswith("draft window") and not images_equal(a[kind], b[kind])]
        assert not bad, f"{key}: {bad} differ from the run without speculation"


def assert_draft_window_is_the_reference_pass(llm, seen: dict, prompts, truth: dict) -> None:
    """The MTP layer's window entries in every recorded image (``record_images``) equal those of the
    reference model's MTP pass over the request's final sequence (prompt + ``truth``)."""
    from dsv4.model.cache import DenseSequenceCache
    from dsv4.model.step import SeqChunk

    model, cfg = llm.engine.model, llm.engine.model_config
    layer = cfg.num_hidden_layers
    for rid, p in zip(truth, prompts):
        ids = torch.tensor(list(p) + truth[rid])
        out = model.forward(ids[:-1], [SeqChunk(model.new_cache(), 0, len(ids) - 1)])
        dense = DenseSequenceCache(cfg, model.numerics)
        model.mtp_forward(ids[1:], out.streams, [SeqChunk(dense, 0, len(ids) - 1)])
        for (r, nc), image in seen.items():
            if r == rid:
                pos = torch.arange(max(0, nc - cfg.sliding_window + 1), nc)
                assert torch.equal(image[f"draft window {layer}"], dense.read_kv(layer, pos)), (rid, nc)
