"""The prefix cache's host tier at tensor_parallel_size=2 on CPU (gloo): every rank offloads and
restores its own copy of the cache, in rank 0's order, so a prompt whose block came back from the
host tier gives the tokens and logprobs of its cold run."""

from __future__ import annotations

import torch
from parallel_helpers import ENGINE
from tiny_vocab import SMALL_VOCAB

from dsv4 import LLM, SamplingParams
from dsv4.cache.paged import unit_bytes
from dsv4.config import load_config
from dsv4.model.cache import CacheNumerics
from dsv4.model.step import BLOCK


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, SMALL_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sig(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids))


def test_tp2_blocks_come_back_from_every_ranks_host_tier(tiny_ckpt):
    blk, swa, slot = unit_bytes(load_config(tiny_ckpt), CacheNumerics("auto"), torch.float32)
    seqs, budget = 2, 512
    pool = seqs * slot + (seqs * 3 + budget // 64 + 2) * swa + 2 * (blk + 2 * swa)  # two blocks
    settings = {**ENGINE, "max_model_len": 2 * BLOCK, "max_num_seqs": seqs, "max_num_batched_tokens": budget,
                "kv_cache_memory": pool, "kv_offloading_size": 4 * (blk + 2 * swa) * 1.001 * 2 / 2**30}
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, distributed_timeout=60, **settings)
    try:
        kv = llm.engine.kv
        assert kv.kvc.budget.num_blocks == 2 and kv.host.num_slots == 4  # (each rank's half of the size)
        prompt = _prompt(1, 260)
        cold = _sig(llm.generate([prompt], sp)[0])
        llm.generate([_prompt(2, 260)], SamplingParams(temperature=0, max_tokens=1))  # evicts the prompt's block
        assert kv.host.offloaded_blocks == 1 and not kv.cached.keys() & set(kv.host.entries)
        again = _sig(llm.generate([prompt], sp)[0])
        assert kv.host_hits == BLOCK and kv.host.restored_blocks == 1
    finally:
        llm.shutdown()
    assert again == cold
