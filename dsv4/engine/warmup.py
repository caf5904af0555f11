"""Start-up warm-up: the step shapes a request can hit, run once before the first real request.

Triton builds a kernel per specialization (a constexpr tile picked from the step's size, a width
that grows with the context; integers and table addresses that vary per step are not specialized on:
``tests/ops/test_ops_specialization_keys.py``); one built in a request's path stalls every stream for
the seconds it takes. The warm-up runs dummy requests through the real scheduler and model so that
those are built (or loaded from the on-disk cache, which ``precompile`` fills in parallel first) at start:

- prefill steps of every length around the tile thresholds (powers of two, ±1), up to the step budget
  (``prefill_lengths``): one prompt, or several when the step is longer than a prompt may be;
- one prompt of ``max_model_len`` − 1 tokens, chunked by the budget: every context the caches reach;
- decodes beside a prefill chunk (a mixed step).

Every request's prompt is its own (``prompt``): a prefix-cache hit on an earlier warm-up prompt would cut
the step short of the size it is there to run (the steps of 512+ tokens, whose attention decodes the
keys once, were never run that way). Decode batches themselves are covered by the decode graphs'
capture. The caches are left as they were: the warm-up's prefix-cache blocks are dropped and its
counters (speculation's too) reset.
"""

from __future__ import annotations

import itertools
import time

from .sampling_params import SamplingParams
from .speculative import SpecStats

TOKEN = 3  # the first plain token id (0 and 1 are BOS and EOS)


def prompt(i: int, n: int, vocab: int) -> list[int]:
    """Request ``i``'s n-token prompt: its number written at the start in the plain ids, so no two share a
    first block and none is a prefix-cache hit of another (a hit would shorten the step it is there to run)."""
    base, head = max(2, vocab - TOKEN), []
    while True:
        i, d = divmod(i, base)
        head.append(TOKEN + d)
        if not i:
            break
    return (head + [TOKEN] * n)[:n]


def prefill_lengths(budget: int) -> list[int]:
    """Step sizes around every power of two up to ``budget`` (±1: the classes an integer argument's
    divisibility by 16 and a power-of-two tile boundary fall in), and ``budget`` itself."""
    out = {1, budget}
    p = 2
    while p <= budget:
        out.update(n for n in (p - 1, p, p + 1) if 1 <= n <= budget)
        p *= 2
    return sorted(out)


def run_warm_up(engine, dry: bool = False) -> dict:
    """Run the plan on ``engine`` (no request of its own may be in flight); returns what ran. ``dry``: the
    listing pass of ``precompile`` (no kernel runs), where a request's failure is no error."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up() needs an idle engine")
    t0 = time.perf_counter()
    cfg = engine.config
    budget = cfg.max_num_batched_tokens
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps = 0
    ids = itertools.count()
    vocab = engine.model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return prompt(next(ids), n, vocab)

    def drain():
        nonlocal steps
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None and not dry:
                    raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error}")
            steps += 1

    longest = engine.max_model_len - 1
    # a step longer than one prompt can be is several prompts of at most the contention cap each
    part = min(longest, engine.scheduler.long_prefill or budget)
    lengths = prefill_lengths(budget)
    for n in lengths:
        sizes = [n] if n <= longest else [part] * (n // part) + ([n % part] if n % part else [])
        for j, size in enumerate(sizes[:cfg.max_num_seqs]):
            engine.add_request(prompt_token_ids=tokens(size), params=greedy, request_id=f"warm-up-prefill-{n}-{j}")
        drain()
    if longest > budget:  # every context the caches reach, a budget-sized chunk at a time
        engine.add_request(prompt_token_ids=tokens(longest), params=greedy, request_id="warm-up-context")
        drain()
    # decodes with a prefill chunk beside them
    for i in range(2):
        engine.add_request(prompt_token_ids=tokens(4), request_id=f"warm-up-decode-{i}",
                           params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    steps += 1
    engine.add_request(prompt_token_ids=tokens(min(budget - 2, 64)), params=greedy, request_id="warm-up-mixed")
    drain()
    engine.kv.reset_prefix_cache()
    engine.kv.reset_stats()
    engine.scheduler.num_preemptions = 0
    engine.spec_stats = SpecStats()  # (the warm-up's drafts are not served ones)
    if getattr(engine, "spec_graphs", None) is not None:
        engine.spec_graphs.replays = 0
    return {"prefill_lengths": lengths, "context": longest if longest > budget else None, "steps": steps,
            "seconds": round(time.perf_counter() - t0, 2)}
