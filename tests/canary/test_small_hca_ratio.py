"""A small HCA ratio (16, as small models like the canary use) runs through the paged engine exactly
like the dense reference: entries per 256-token block = 16, a state ring of one 16-row block, no
overlap, prefix-cache hits at block ends. Bitwise on CPU, in both cache dtypes, with chunked
prefill cutting blocks at odd places and a prefix-cache hit on the second pass.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config import ConfigError, LayerType, config_from_dict
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM

LENGTHS = (5, 15, 16, 17, 130, 300, 530)  # around the 16-row entries, the window and the block
NEW = 4


@pytest.fixture(scope="module")
def ratio16_ckpt(tmp_path_factory):
    from dsv4.checkpoint.synthetic import write_checkpoint

    out = tmp_path_factory.mktemp("ratio16")
    return write_checkpoint(out, preset="tiny", progress=False, overrides={"compress_ratios": [0, 4, 16, 4, 0]})


def test_config_accepts_small_hca_ratios_only():
    from dsv4.checkpoint.synthetic import build_config

    for r in (8, 16, 32, 64, 256):
        cfg = config_from_dict(build_config("tiny", overrides={"compress_ratios": [0, 4, r, 4, 0]}))
        assert cfg.layer_type(2) == LayerType.HCA and cfg.compress_ratio(2) == r
    for bad in (2, 12, 48, 512):
        with pytest.raises(ConfigError, match=rf"'compress_ratios\[2\]'.*found {bad}"):
            build_config("tiny", overrides={"compress_ratios": [0, 4, bad, 4, 0]})


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_ds_mla"])
def test_ratio16_engine_equals_dense_reference(ratio16_ckpt, kv_dtype):
    g = torch.Generator().manual_seed(16)
    prompts = [torch.randint(3, 129000, (n,), generator=g).tolist() for n in LENGTHS]
    llm = LLM(str(ratio16_ckpt), kv_cache_dtype=kv_dtype, max_model_len=1024, kv_cache_memory=256 << 20,
              max_num_batched_tokens=200, max_num_seqs=8, enable_prefix_caching=True, backend="torch")
    model = llm.engine.model
    assert model.cfg.compress_ratio(2) == 16 and llm.engine.kv_cache.per_block((2, "kv")) == 16
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    refs = [model.greedy(p, NEW) for p in prompts]  # the dense reference, once for both passes
    for rnd in range(2):  # the second pass hits the prefix cache for the 530-token prompt's first block
        outs = llm.generate(prompts, params)
        for p, out, (ref_tokens, ref_logits) in zip(prompts, outs, refs):
            c = out.outputs[0]
            assert c.token_ids == ref_tokens, f"pass {rnd}, prompt of {len(p)}: engine {c.token_ids} != {ref_tokens}"
            ref_lp = torch.log_softmax(ref_logits.float(), dim=-1)
            got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            assert got == [float(ref_lp[i, t]) for i, t in enumerate(ref_tokens)], f"pass {rnd}, prompt of {len(p)}"
    assert llm.engine.kv.hits >= 256
