"""The engine's greedy tokens equal the reference model's, concurrently, under preemption, and from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import BOUNDARY_NEW_TOKENS as N_NEW
from engine_helpers import DTYPES, assert_no_leaks, greedy, make_llm

from dsv4.cache.paged import plan_budget, unit_bytes
from dsv4.config import load_config
from dsv4.model.cache import CacheNumerics


def _check_against_reference(llm, prompts, outs, reference_greedy):
    model = llm.engine.model
    for p, out in zip(prompts, outs):
        c = out.outputs[0]
        ref_tokens, ref_logits = reference_greedy(model, p, N_NEW)
        assert c.token_ids == ref_tokens, f"prompt of {len(p)} tokens: engine {c.token_ids} != reference {ref_tokens}"
        assert c.finish_reason == "length" and c.stop_reason is None
        # the engine's logits are bitwise the reference's at every step (paged vs dense cache, batched
        # vs alone), so the logprobs it reports are exactly log_softmax of the reference's logits
        ref_lp = torch.log_softmax(ref_logits.float(), dim=-1)
        got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        want = [float(ref_lp[i, t]) for i, t in enumerate(ref_tokens)]
        assert got == want, f"logprobs of the prompt of {len(p)} tokens differ from the reference"


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_concurrent_greedy_matches_reference(tiny_ckpt, kv_dtype, boundary_prompts, reference_greedy):
    llm = make_llm(tiny_ckpt, kv_dtype, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048)
    engine = llm.engine
    ids = [engine.add_request(p, greedy(N_NEW)) for p in boundary_prompts]
    first = engine.step()
    # all eight prompts (1,459 tokens < the 2,048 budget) ran in one batch and each sampled its first token
    assert len(engine.scheduler.running) == len(boundary_prompts) and not engine.scheduler.waiting
    assert sorted(o.request_id for o in first) == sorted(ids)
    done = engine.run_to_completion(ids)
    outs = [done[r] for r in ids]
    _check_against_reference(llm, boundary_prompts, outs, reference_greedy)
    assert engine.scheduler.num_preemptions == 0
    assert_no_leaks(llm)


def _tiny_cache_bytes(ckpt, kv_dtype, max_model_len, max_num_seqs, max_num_batched_tokens, extra_blocks):
    """Budget bytes that give the one-request minimum of blocks plus ``extra_blocks``."""
    cfg, numerics = load_config(ckpt), CacheNumerics(kv_dtype)
    blk, swa, _ = unit_bytes(cfg, numerics, torch.float32)
    big = plan_budget(cfg, numerics, torch.float32, 1 << 34, max_num_seqs, max_num_batched_tokens, max_model_len)
    fixed = big.total_bytes - big.num_blocks * (blk + 2 * swa)  # slots + the per-sequence SWA reserve
    need = -(-max_model_len // 256)
    minimum = fixed + need * (blk + 2 * swa)
    plan_budget(cfg, numerics, torch.float32, minimum, max_num_seqs, max_num_batched_tokens, max_model_len)
    with pytest.raises(ValueError):
        plan_budget(cfg, numerics, torch.float32, minimum - 1, max_num_seqs, max_num_batched_tokens, max_model_len)
    return minimum + extra_blocks * (blk + 2 * swa), need + extra_blocks


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_preemption_under_tiny_cache_matches_reference(tiny_ckpt, kv_dtype, boundary_prompts, reference_greedy):
    # 512 tokens of context need 2 blocks; give the cache 3 while the 8 prompts need 11 together.
    # Order: the 255-token prompt runs first and needs a 2nd block for its 3rd token, when the
    # others hold every block, so a running request must be preempted and later recomputed.
    order = [5, 4, 3, 7, 0, 1, 2, 6]  # lengths 255, 129, 126, 300, 5, 63, 64, 257
    prompts = [boundary_prompts[i] for i in order]
    mem, n_blocks = _tiny_cache_bytes(tiny_ckpt, kv_dtype, 512, 8, 2048, extra_blocks=1)
    llm = make_llm(tiny_ckpt, kv_dtype, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
                   kv_cache_memory=mem)
    engine = llm.engine
    assert engine.kv_cache.budget.num_blocks == n_blocks == 3
    outs = llm.generate(prompts, greedy(N_NEW))
    assert engine.scheduler.num_preemptions > 0
    _check_against_reference(llm, prompts, outs, reference_greedy)
    assert_no_leaks(llm)


def test_cli_generate_json(tiny_ckpt_release_vocab, tiny_model_fp8, reference_greedy):
    """``dsv4 generate --json`` on a text prompt (the release vocabulary: the tokenizer's ids)."""
    exe = shutil.which("dsv4", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "dsv4.cli"]
    cmd += ["generate", "--model", str(tiny_ckpt_release_vocab), "--prompt", "The quick brown fox", "--max-tokens", "4",
            "--json", "--kv-cache-memory", "256"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as the in-process tests
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"token_ids", "tokens", "finish_reason"} <= set(d)
    ids = d["token_ids"]
    assert 1 <= len(ids) <= 4 and all(isinstance(t, int) for t in ids)
    assert len(d["tokens"]) == len(ids) and all(isinstance(t, str) for t in d["tokens"])
    assert d["finish_reason"] == ("length" if len(ids) == 4 else "stop")
    # the CLI defaults to greedy with the fp8_ds_mla cache: the reference gives the same tokens
    ref, _ = reference_greedy(tiny_model_fp8, d["prompt_token_ids"], 4)  # (built on tiny_ckpt_release_vocab)
    assert ids == ref[: len(ids)]
