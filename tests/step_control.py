"""Run engine steps with an exact, hand-picked batch (for batch-invariance tests).

The scheduler mixes decodes and prefill chunks as the budget allows; a batch-invariance test
needs to say *which* requests share a step. ``step_with(engine, reqs)`` schedules exactly the
remaining tokens of ``reqs`` in one step and returns each request's logits row(s) of that step.
"""

from __future__ import annotations

import torch

from dsv4.engine.request import Status
from dsv4.engine.scheduler import ScheduledChunk


def step_with(engine, reqs, tokens: list[int] | None = None) -> dict[int, torch.Tensor]:
    """One engine step over exactly ``reqs`` (each takes all its uncomputed tokens, or
    ``tokens[i]`` of them: a prefill chunk); returns id(request) → the logits row it sampled from
    (float32, on the host; a partial prefill chunk samples nothing)."""
    if engine.config.async_scheduling:
        raise RuntimeError("step_with runs one synchronous step: build the engine with async_scheduling=False")
    sched = []
    for i, r in enumerate(reqs):
        n = r.num_tokens - r.num_computed if tokens is None else tokens[i]
        if not engine.kv.can_allocate(r.alloc, n):
            raise RuntimeError(f"request {r.request_id}: no pages for {n} tokens")
        engine.kv.allocate(r.alloc, n)
        if r.status != Status.RUNNING:
            engine.scheduler.waiting.remove(r)
            engine.scheduler.running.append(r)
            r.status = Status.RUNNING
        sched.append(ScheduledChunk(r, n))
    captured = {}
    run = engine.runner.run

    def capture(schedule):
        batch, logits = run(schedule)
        for row, si in batch.sample_rows:
            captured[id(schedule[si].req)] = logits[row].clone()
        return batch, logits

    engine.scheduler.schedule, engine.runner.run = (lambda: sched), capture
    try:
        engine.step()
    finally:
        del engine.scheduler.schedule, engine.runner.run
    return captured


def add(engine, prompt: list[int], max_tokens: int = 64):
    """Add a greedy request and return its Request object."""
    from dsv4.engine.sampling_params import SamplingParams

    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                            ignore_eos=True))
    return engine.requests[rid][0]


def decode_logits(engine, target, others, steps: int, target_at: int = 0) -> list[torch.Tensor]:
    """Prefill ``target`` alone, each other request alone, then ``steps`` decode steps of all of
    them together (target at index ``target_at``); the target's logits of each decode step."""
    step_with(engine, [target])
    for o in others:
        step_with(engine, [o])
    out = []
    for _ in range(steps):
        batch = list(others)
        batch.insert(min(target_at, len(batch)), target)
        out.append(step_with(engine, batch)[id(target)])
    return out
