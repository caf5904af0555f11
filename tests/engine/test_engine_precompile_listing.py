"""``engine.precompile``'s listing pass runs the warm-up plan with no kernel launched and every allocation
zeroed: the engine must come out of it as from the warm-up itself — same tokens, nothing cached, no
counter moved — and ``torch.empty`` must be itself again."""

import torch

from dsv4.engine.precompile import list_launches, zeroed_allocations
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM

PROMPTS = [[5, 6, 7, 8] * 70, [9, 10, 11]]


def _tokens(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6))
    return [o.outputs[0].token_ids for o in outs]


def test_the_listing_pass_leaves_the_engine_as_it_found_it(tiny_ckpt):
    kw = dict(max_model_len=512, kv_cache_memory=1 << 28, max_num_batched_tokens=128, max_num_seqs=4)
    want = _tokens(LLM(str(tiny_ckpt), **kw))
    llm = LLM(str(tiny_ckpt), **kw)
    eng = llm.engine
    list_launches(eng, None)
    assert not eng.has_unfinished_requests()
    assert eng.kv.queries == 0 and eng.scheduler.num_preemptions == 0
    assert _tokens(llm) == want


def test_zeroed_allocations_are_undone():
    empty = torch.empty
    with zeroed_allocations():
        assert torch.empty is not empty
        assert not torch.empty(1000).any() and not torch.empty_like(torch.ones(8)).any()
        assert not torch.ones(3).new_empty(100).any()
    assert torch.empty is empty
