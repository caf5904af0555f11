"""``dsv4 diff``: the layered evidence chain names the first place two backends part.

On CPU without ``TRITON_INTERPRET=1`` the Triton backend is reported unavailable, so these tests
compare torch against torch with a fault planted in side B only (a side may bring its own model
object and its own paged-view class).
"""

from __future__ import annotations

import io

import pytest
import torch

from dsv4.cache.paged import PagedSequenceView
from dsv4.formats import dequantize_kv
from dsv4.model.cache import CacheNumerics
from dsv4.model.model import ReferenceModel
from dsv4.validate.diff import DiffOptions, Side, compare_tensors, run_diff

PROMPT_LEN = 70  # crosses the 64-token SWA page; 17 CSA entries


def diff(ckpt, a, b, view_b=None, **kw):
    opts = DiffOptions(model=str(ckpt), backend_a="torch", backend_b="torch", prompt_len=PROMPT_LEN, greedy_tokens=3,
                       **kw)
    out = io.StringIO()
    rep = run_diff(opts, out=out, sides=[Side("A", "torch", model=a), Side("B", "torch", model=b, view_cls=view_b)])
    return rep, out.getvalue()


@pytest.fixture(scope="module")
def twin(validate_model):
    """A second model object over the same weights (so B can be altered without touching A)."""
    return ReferenceModel(validate_model.w, numerics=CacheNumerics("fp8_ds_mla"))


def test_identical_backends_agree_everywhere(tiny_ckpt, validate_model, twin, tmp_path):
    rep, text = diff(tiny_ckpt, validate_model, twin, json_report=str(tmp_path / "d.json"))
    assert rep.status == "PASS" and rep.exit_code == 0, text
    stages = {r.stage for r in rep.rows}
    assert stages == {"cache round trip (A)", "cache round trip (B)", "prefill hidden", "decode step",
                      "next-token logits", "greedy"}
    wheres = [r.where for r in rep.rows if r.stage == "decode step"]
    for op in ("layers.1.attn.q", "layers.1.attn.k_window", "layers.1.attn.k_compressed", "layers.1.attn.logits",
               "layers.1.attn.probs", "layers.1.attn.out", "layers.1"):
        assert op in wheres
    assert all(r.max_abs == 0 for r in rep.rows if r.max_abs is not None)
    assert "scale bytes of token 0: [" in text and "DIFF_VERDICT: PASS" in text
    assert (tmp_path / "d.json").exists()


class WrongLayoutView(PagedSequenceView):
    """Side B's cache reader assumes 584 contiguous bytes per token (the writer is block-packed)."""

    def read_kv(self, layer, positions):
        pages, off = self._swa_slots(positions)
        t = self.kvc.swa[layer]
        cols = off.long()[:, None] * 584 + torch.arange(584)
        rows = t[pages[:, None], cols]
        return dequantize_kv(rows[:, :576], rows[:, 576:584], self.numerics.fmt).to(self.kvc.dtype)


def test_wrong_cache_reader_is_named_at_the_round_trip(tiny_ckpt, validate_model, twin):
    rep, text = diff(tiny_ckpt, validate_model, twin, view_b=WrongLayoutView)
    assert rep.status == "FAIL" and rep.exit_code == 1
    fd = rep.first_divergence
    assert fd.stage == "cache round trip (B)" and fd.where.startswith("layers.0 window KV")
    assert "the reader" in fd.note and "bytes at the writer's addresses == codec" in fd.note
    assert all(r.status == "PASS" for r in rep.rows if r.stage == "cache round trip (A)")
    assert "FIRST_DIVERGENCE: cache round trip (B) / layers.0 window KV" in text


def test_planted_attention_fault_is_named_at_its_layer(tiny_ckpt, validate_model, monkeypatch):
    """Side B's layer-2 (HCA) attention output projection carries 30 % noise: the chain parts at the
    prefill's layer-2 residual stream, and in the decode step at layer 2's attention output (its q and
    decoded keys still agree: they come from layer 1)."""
    b = ReferenceModel(validate_model.w, numerics=CacheNumerics("fp8_ds_mla"))
    attn = b.blocks[2].attn
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(attn.wo_b.shape, generator=g) * attn.wo_b.std() * 0.3
    monkeypatch.setattr(attn, "wo_b", attn.wo_b + noise)
    rep, text = diff(tiny_ckpt, validate_model, b)
    assert rep.status == "FAIL"
    fd = rep.first_divergence
    assert (fd.stage, fd.where) == ("prefill hidden", f"layers.2 (last token of {PROMPT_LEN})"), text
    assert 1 - fd.cos > 1e-3
    assert "FIRST_DIVERGENCE: prefill hidden / layers.2" in text
    first_decode = next(r for r in rep.rows if r.stage == "decode step" and r.status == "FAIL")
    assert first_decode.where == "layers.2.attn.out"
    assert all(r.status == "PASS" for r in rep.rows if r.stage.startswith("cache round trip"))
    assert all(
        r.status == "PASS"
        for r in rep.rows
        if r.stage == "prefill hidden" and r.where.startswith(("layers.0", "layers.1"))
    )
    rows = {r.where: r for r in rep.rows if r.stage == "decode step"}
    assert all(rows[w].status == "PASS" for w in rows if w.startswith(("layers.0", "layers.1")))
    assert rows["layers.2.attn.q"].status == "PASS" and rows["layers.2.attn.k_window"].status == "PASS"


def test_triton_side_unavailable_on_plain_cpu(tiny_ckpt, monkeypatch):
    from dsv4.ops.platform import detect_platform

    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the Triton kernels")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    detect_platform.cache_clear()
    try:
        out = io.StringIO()
        rep = run_diff(DiffOptions(model=str(tiny_ckpt), backend_a="torch", backend_b="triton"), out=out)
    finally:
        detect_platform.cache_clear()
    assert rep.status == "UNAVAILABLE" and rep.exit_code == 2
    assert "TRITON_INTERPRET=1" in out.getvalue()


def test_compare_tensors_tolerances():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert compare_tensors(a, a.clone(), 1e-3, 1e-2)[3] == "PASS"
    assert compare_tensors(a, a * 1.001, 1e-3, 1e-2)[3] == "PASS"
    assert compare_tensors(a, a * 1.001, 1e-3, 1e-2, exact=True)[3] == "FAIL"
    assert compare_tensors(a, torch.tensor([1.0, float("nan"), 3.0]), 1, 1)[4] == "non-finite in B (1 values)"
    assert compare_tensors(a, -a, 1e-3, 1e-2)[3] == "FAIL"
