"""The reference is batch-invariant, so its own paths agree BITWISE (``torch.equal``, no tolerance).

Design (dsv4/model/linear.py): a token's result never depends on which other tokens share the
batch or chunk — GEMM rows are padded to a multiple of 8 (CPU BLAS uses another kernel for a
trailing partial row tile), transcendental ops (exp, sigmoid, softmax, sin/cos, silu) run in
float64 and are rounded to float32 (vectorised and scalar tails differ by an ulp), attention
reduces keys in fixed 64-key blocks, indexer scores use fixed-width 64-column key padding, and
every top-k breaks ties to the lowest index. So one full forward, prefill + single-token decode,
and chunked prefill with ANY chunking must give identical results, in both cache dtypes. Any
difference here is a real bug (a chunk-boundary or cache-state error), never "rounding".
(Evidence that the padding matters: with it removed, the "ramp" chunking below differs from the
full forward from row 0 on, max |Δlogit| 5.7e-6.)

The prompt is 640 tokens: 160 CSA windows (ratio 4, overlapping) and 5 HCA windows (ratio 128),
window 128. Chunkings split windows on purpose (boundaries at every residue mod 4, at 127 mod 128
and mid-HCA-window). What is compared: the residual streams of EVERY row (the complete model
state: logits are a row-wise function of them) and the logits of each chunk's last row; the
vocabulary projection of all 640 rows is computed once (the shared full forward), not per chunking.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4.model.step import SeqChunk

N_PROMPT = 640  # the prompt of the shared ``full_forward_640`` fixture (tests/model/conftest.py)
DTYPES = ["auto", "fp8_ds_mla"]

# chunk sizes; each sums to 640. Comments give the last position of the first chunks.
CHUNKINGS = {
    # 1, 2, ..., 12 then the rest: chunks end at p = 0, 2, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77:
    # every residue mod 4, so the overlap (previous-block) rows of a CSA window come from an
    # earlier chunk, and several single-token chunks close a window.
    "ramp": list(range(1, 13)) + [N_PROMPT - 78],
    # ends at 126, 127 (a 1-token chunk that closes CSA block 31 AND HCA block 0), 255 (HCA
    # block 1 closes on a chunk edge), 510 (mid-HCA, p ≡ 2 mod 4), 639
    "hca_edges": [127, 1, 128, 255, 129],
    # aligned 4-token chunks (each closes exactly its own CSA block), then a 3-token chunk that
    # shifts every later boundary to p ≡ 2 mod 4 (each chunk then splits a CSA window)
    "fours": [4] * 6 + [3] + [4] * 6 + [N_PROMPT - 51],
}


def _prompt(n: int = N_PROMPT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # seed 0, n 640: the prompt of ``full_forward_640``
    return torch.randint(2, 129280, (n,), generator=g)


@torch.no_grad()
def run_chunks(model, ids, sizes, cache=None):
    """Forward ``ids`` chunk by chunk; returns (streams of every row, logits of each chunk's last row, cache)."""
    cache = cache or model.new_cache()
    start, off, streams, last = cache.num_tokens, 0, [], []
    for n in sizes:
        out = model.forward(ids[off: off + n], [SeqChunk(cache, start + off, n)], logits_rows=torch.tensor([n - 1]))
        streams.append(out.streams)
        last.append(out.logits)
        off += n
    return torch.cat(streams), torch.cat(last), cache


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    rows = (a != b).reshape(a.shape[0], -1).any(-1).nonzero().flatten()
    return f"first differing row {int(rows[0])}, max |Δ| {float((a - b).abs().max()):.3e}" if rows.numel() else "equal"


@pytest.fixture(scope="module")
def models(tiny_model_auto, tiny_model_fp8):
    return {"auto": tiny_model_auto, "fp8_ds_mla": tiny_model_fp8}


@pytest.mark.parametrize("name", list(CHUNKINGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_full_forward(models, full_forward_640, dtype, name):
    sizes = CHUNKINGS[name]
    assert sum(sizes) == N_PROMPT
    full = full_forward_640(dtype)
    streams, last, cache = run_chunks(models[dtype], _prompt(), sizes)
    assert torch.equal(streams, full.streams), f"{dtype} chunking {name}: streams {_first_diff(streams, full.streams)}"
    ends = torch.tensor(sizes).cumsum(0) - 1
    assert torch.equal(last, full.logits[ends]), (
        f"{dtype} chunking {name}: logits {_first_diff(last, full.logits[ends])}"
    )
    assert cache.num_tokens == N_PROMPT


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(models, full_forward_640, dtype):
    """Prefill 608, then 32 single-token decode steps (positions 608..639: 8 CSA closes and the
    HCA close at 639 happen inside decode) == rows of the 640-token forward."""
    model, ids, P = models[dtype], _prompt(), 608
    full = full_forward_640(dtype)
    streams, last, cache = run_chunks(model, ids, [P])
    assert torch.equal(streams, full.streams[:P]), f"{dtype} prefill: {_first_diff(streams, full.streams[:P])}"
    assert torch.equal(last[0], full.logits[P - 1])
    for p in range(P, N_PROMPT):
        out = model.forward(ids[p : p + 1], [SeqChunk(cache, p, 1)])
        assert torch.equal(out.logits[0], full.logits[p]), (
            f"{dtype} decode at {p}: {_first_diff(out.logits, full.logits[p : p + 1])}"
        )
        assert torch.equal(out.streams[0], full.streams[p])
    assert cache.num_tokens == N_PROMPT


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_same_whole_or_chunked_prompt(models, dtype):
    """Greedy generation after a whole-prompt prefill == after a chunked prefill (tokens and every
    step's logits bitwise). The 300-token prompt is chunked [127, 1, 128, 43] + the last token
    through ``greedy`` itself: 1-token chunks close HCA block 0 (p=127) and CSA block 74 (p=299)."""
    model, ids, n_new = models[dtype], _prompt(300, seed=4), 6
    whole_tokens, whole_logits = model.greedy(ids.tolist(), n_new)
    _, _, cache = run_chunks(model, ids, [127, 1, 128, 43])
    tokens, logits = model.greedy(ids[299:].tolist(), n_new, cache=cache)
    assert tokens == whole_tokens
    assert torch.equal(logits, whole_logits), _first_diff(logits, whole_logits)


@torch.no_grad()
def test_mixed_batch_is_batch_invariant(tiny_model_fp8):
    """One forward over [seq A: 1 decode token, seq B: a 57-token prefill chunk, seq C: 3 tokens]
    gives each sequence exactly what it gets alone (rows and caches are independent)."""
    model = tiny_model_fp8
    a, b, c = _prompt(201, seed=1), _prompt(185, seed=2), _prompt(131, seed=3)
    _, _, ca = run_chunks(model, a, [200])
    _, _, cb = run_chunks(model, b, [128])
    _, _, cc = run_chunks(model, c, [128])
    ca2, cb2, cc2 = copy.deepcopy(ca), copy.deepcopy(cb), copy.deepcopy(cc)
    batch = torch.cat([a[200:], b[128:], c[128:]])
    mixed = model.forward(batch, [SeqChunk(ca, 200, 1), SeqChunk(cb, 128, 57), SeqChunk(cc, 128, 3)])
    alone = [
        model.forward(a[200:], [SeqChunk(ca2, 200, 1)]),
        model.forward(b[128:], [SeqChunk(cb2, 128, 57)]),
        model.forward(c[128:], [SeqChunk(cc2, 128, 3)]),
    ]
    assert torch.equal(mixed.streams, torch.cat([o.streams for o in alone]))
    assert torch.equal(mixed.logits, torch.cat([o.logits for o in alone]))
    # the caches continue identically too
    nxt = model.forward(b[185 - 1 :], [SeqChunk(cb, 185, 1)]).logits
    assert torch.equal(nxt, model.forward(b[185 - 1 :], [SeqChunk(cb2, 185, 1)]).logits)
