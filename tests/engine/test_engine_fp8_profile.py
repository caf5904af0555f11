"""The FP8 encoding of every cache writer and reader comes from the platform profile, and a
profile can be forced (DSV4_PLATFORM_FP8) so the FNUZ path is testable on any machine."""

import torch
from engine_helpers import rand_prompt

from dsv4 import LLM, SamplingParams
from dsv4.model.cache import CacheNumerics
from dsv4.model.model import ReferenceModel
from dsv4.ops.platform import detect_platform


def test_forced_fnuz_profile_drives_the_cache_bytes(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("DSV4_PLATFORM_FP8", "fnuz")
    detect_platform.cache_clear()
    try:
        llm = LLM(str(tiny_ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=512, kv_cache_memory=128 << 20)
        assert llm.engine.config.fp8_format == "fnuz"
        assert llm.engine.kv_cache.numerics.fmt.name == "fnuz"
        prompt = rand_prompt(torch.Generator().manual_seed(3), 70)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        ref = ReferenceModel(llm.engine.model.w, numerics=CacheNumerics("fp8_ds_mla", "fnuz"))
        assert out.outputs[0].token_ids == ref.greedy(prompt, 3)[0]
        assert llm.engine.kv.leaks() == []
    finally:
        monkeypatch.delenv("DSV4_PLATFORM_FP8")
        detect_platform.cache_clear()
    assert detect_platform().fp8_format == "ocp"
