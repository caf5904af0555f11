"""Shared helpers for tests/engine (imported by its conftest and test files)."""

from __future__ import annotations

import torch
from tiny_vocab import SMALL_VOCAB

from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM

DTYPES = ("auto", "fp8_ds_mla")
# lengths around the 64-token SWA page, the 128-token window / HCA ratio, the ratio-4 groups and
# the 256-token block; with 4 new tokens 63, 126 and 255 also cross a boundary while decoding
BOUNDARY_LENGTHS = (5, 63, 64, 126, 129, 255, 257, 300)
BOUNDARY_NEW_TOKENS = 4
TOKEN_LO, TOKEN_HI = 3, SMALL_VOCAB  # avoid BOS/EOS (0/1); tests/engine's tiny_ckpt is of the small vocabulary


def rand_prompt(gen: torch.Generator, n: int, hi: int = TOKEN_HI) -> list[int]:
    return torch.randint(TOKEN_LO, hi, (n,), generator=gen).tolist()


def rand_prompts(seed: int, lengths, hi: int = TOKEN_HI) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [rand_prompt(g, int(n), hi) for n in lengths]


def make_llm(ckpt, kv_cache_dtype: str, *, max_model_len: int = 1024, kv_cache_memory: int = 256 << 20,
             max_num_batched_tokens: int = 2048, max_num_seqs: int = 16, enable_prefix_caching: bool = True,
             **kw) -> LLM:
    return LLM(str(ckpt), kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
               kv_cache_memory=kv_cache_memory, max_num_batched_tokens=max_num_batched_tokens,
               max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching, **kw)


def greedy(max_tokens: int, logprobs: int | None = 0, **kw) -> SamplingParams:
    """Greedy params; ``logprobs=0`` makes each output carry the sampled token's logprob (for bitwise checks)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs, **kw)


def signature(out) -> tuple:
    """(token ids, logprob of each sampled token) of a single-completion RequestOutput: bitwise comparable."""
    c = out.outputs[0]
    lps = tuple(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)) if c.logprobs is not None else None
    return tuple(c.token_ids), lps


def assert_no_leaks(llm_or_engine) -> None:
    """Nothing alive and every page, block and slot either free or held only by the prefix cache."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished_requests(), "requests still queued or running"
    assert engine.requests == {}, f"engine still tracks requests {list(engine.requests)}"
    assert engine.kv.leaks() == []


def assert_all_free_after_reset(llm_or_engine) -> None:
    """``reset_prefix_cache()`` with nothing alive returns every block, SWA page and slot to the free lists."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    kv = engine.kv
    kv.reset_prefix_cache()
    assert kv.cached == {} and kv.block_hash == {}
    for pool in (kv.blocks, kv.swa):
        assert len(pool.evictable) == 0, f"{pool.name}: {len(pool.evictable)} still cached after reset"
        assert sorted(pool.free) == list(range(pool.n)), f"{pool.name}: free list incomplete or duplicated"
        assert all(r == 0 for r in pool.ref)
    assert sorted(kv.free_slots) == list(range(kv.kvc.budget.num_slots))
