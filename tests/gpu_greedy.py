"""Greedy tokens of two engine runs on the GPU, compared where the reference run's top-2 logprob
margin exceeds a tolerance: bf16 sums of different kernels differ in the last bits, so a first
disagreement is allowed only at a step whose margin is within it. The tolerance is stated, not
fitted: several times the bf16 logit noise measured between the paths (docs/perf.md, "Correctness
on the GPU")."""

from __future__ import annotations

import torch

TOL = 0.05  # nats


def greedy_run(ckpt, lengths, new: int, seed: int, logprobs: int | None = 2, params: dict | None = None,
               **settings):
    """An LLM on ``ckpt`` (``settings`` added) and its greedy outputs (top-2 logprobs; ``logprobs=None``:
    none, the requests plain greedy) for random prompts of ``lengths``; ``params``: sampling
    parameters that replace greedy's (e.g. top-k 1 sampling, whose tokens are greedy's)."""
    from dsv4.config import load_config
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.llm import LLM

    g = torch.Generator().manual_seed(seed)
    hi = min(120000, load_config(ckpt).vocab_size)  # (ids 0-2: BOS, EOS and a spare)
    prompts = [torch.randint(3, hi, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(str(ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=1024, kv_cache_memory=1 << 30,
              max_num_seqs=16, max_num_batched_tokens=512, **settings)
    outs = llm.generate(prompts, SamplingParams(**{"temperature": 0, "max_tokens": new, "ignore_eos": True,
                                                   "logprobs": logprobs, **(params or {})}))
    return llm, [o.outputs[0] for o in outs]


def assert_greedy_agrees(got, ref, lengths, what: str, tol: float = TOL) -> int:
    """Each request's tokens in ``got`` equal ``ref``'s up to a first disagreement at a step whose
    margin in ``ref`` is ≤ ``tol``; returns how many tokens were compared equal."""
    checked = 0
    for n, a_out, r_out in zip(lengths, got, ref):
        for i, (a, b) in enumerate(zip(a_out.token_ids, r_out.token_ids)):
            top = sorted(r_out.logprobs[i].values(), key=lambda lp: -lp.logprob)
            margin = top[0].logprob - top[1].logprob
            if a != b:
                assert margin <= tol, (f"prompt of {n} tokens, step {i}: {what} picked {a} against {b} with a "
                                       f"top-2 margin of {margin:.3f} > {tol}")
                break
            checked += 1
    return checked
