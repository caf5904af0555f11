"""Async scheduling: the next step is scheduled and launched before this step's tokens reach the host.

A synchronous decode step ends by copying its sampled tokens to the host; only then can the next
step be scheduled and its inputs built, so the GPU idles for the host's whole share of a step. With
``EngineConfig.async_scheduling`` (vLLM's ``--async-scheduling``) a step whose sampled rows are all
plain greedy leaves its picks on the device (``InFlight``); the next ``step()`` call then

1. gives every request of the in-flight step that may continue a pending token
   (``Request.pending_tokens``, outside its output), so the scheduler counts and allocates the token
   that is being computed;
2. schedules, builds the inputs on the host, and copies each placeholder's real token into the
   step's token ids on the device, from the in-flight step's picks (``device_token_plan``);
3. launches it, and only then waits for the in-flight step's picks and applies them (the engine:
   stop checks, detokenization, outputs). A request that stopped there was computed one token too
   far: that token is dropped, its pages were freed after the launch, in stream order.

A step that cannot be launched this way (a request that samples otherwise, prompt logprobs, a
placeholder in a prefill chunk) waits for the in-flight step first, exactly as
without async scheduling. The tokens are the same either way: the same greedy picks of the same
logits, a step later on the host; only when each step's outputs are reported changes (one
``step()`` call later).

Under tensor parallelism every rank gets the full logits (the vocab-parallel head is all-gathered),
so each rank picks the same greedy tokens itself and keeps them on its device: a deferred step's
plan names the rows to fill (``HostInputs.fill``) instead of carrying token ids that only exist on
the device (``dsv4.parallel.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .runner import ModelRunner, StepBatch
from .sampler import device_picks, plain_greedy


@dataclass
class InFlight:
    """A launched step whose greedy picks have not been read: the picks on the device (logits row
    order), their host copy and whether each row was finite (filled when ``event`` completes)."""
    schedule: list
    batch: StepBatch
    picks: torch.Tensor  # int64 [rows] on the device
    host: torch.Tensor  # int64 [2, rows]: picks and finite flags, on the host
    event: torch.cuda.Event | None


def deferrable(schedule: list, sampler) -> bool:
    """Whether a step's samples can stay on the device: every request that samples this step is
    plain greedy (``greedy_picks``' condition), none asks for prompt logprobs, and the sampler lets
    the engine pick rows in a batch."""
    if not getattr(sampler, "batched_greedy", False):
        return False
    for sc in schedule:
        req = sc.req
        if req.params.prompt_logprobs is not None:
            return False
        if req.alloc.num_computed + sc.num_tokens == req.num_tokens and not plain_greedy(req):
            return False
    return True


def add_placeholders(prev: InFlight) -> None:
    """A pending token for each request of ``prev`` that samples and may continue (not finished, and
    not at its last token: a request whose pick reaches max_tokens ends there)."""
    for _, si in prev.batch.sample_rows:
        req = prev.schedule[si].req
        if req.finished:
            continue
        n_after = len(req.output_token_ids) + 1
        if req.params.max_tokens is not None and n_after >= req.params.max_tokens:
            continue
        req.pending_tokens += 1


def device_token_plan(schedule: list, prev: InFlight | None) -> list[tuple[int, int]] | None:
    """(token-id row of this step, picks row of ``prev``) for every placeholder this step reads, or
    None when a placeholder is anywhere but the single token of a decode chunk of a request ``prev``
    sampled (e.g. a preempted request recomputed from its prompt): then ``prev`` is read first."""
    src = {} if prev is None else {id(prev.schedule[si].req): row for row, si in prev.batch.sample_rows}
    plan, off = [], 0
    for sc in schedule:
        req = sc.req
        if req.pending_tokens:
            last = req.num_tokens - 1  # the placeholder's position
            start = req.alloc.num_computed
            if start <= last < start + sc.num_tokens:
                if sc.num_tokens != 1 or id(req) not in src:
                    return None
                plan.append((off, src[id(req)]))
        off += sc.num_tokens
    return plan


def launch(runner: ModelRunner, schedule: list, prev: InFlight | None, pick=None) -> InFlight | None:
    """Build and run a deferrable step, its placeholder token ids taken from ``prev``'s picks on the
    device; its greedy picks stay there (copied to the host without waiting). None, with nothing
    built or run, when a placeholder cannot be filled that way."""
    plan = device_token_plan(schedule, prev)
    if plan is None:
        return None
    batch = runner.build(schedule)
    batch.host.fill, batch.host.deferred = plan, True  # (a multi-process executor repeats both on every rank)
    fill_tokens(batch.token_ids, prev.picks if plan else None, plan)
    logits = runner.execute(batch)
    if [row for row, _ in batch.sample_rows] != list(range(logits.shape[0])):
        raise RuntimeError("a deferred step's logits rows must be its sampled rows, in order")
    both = device_picks(logits, pick)  # the picks and finite flags greedy_picks reads, left on the device
    picks = both[0]
    event = None
    if both.device.type == "cuda":
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host = both.cpu()
    return InFlight(schedule, batch, picks, host, event)


def fill_tokens(token_ids: torch.Tensor, picks: torch.Tensor | None, plan: list[tuple[int, int]]) -> None:
    """``token_ids[d] = picks[s]`` for each (d, s) of ``plan``, on the device (no host wait)."""
    if not plan:
        return
    if all(d == i and s == i for i, (d, s) in enumerate(plan)):  # steady decode: same order
        token_ids[:len(plan)].copy_(picks[:len(plan)])
        return
    dst = _to_device([d for d, _ in plan], token_ids.device)
    src = _to_device([s for _, s in plan], picks.device)
    token_ids.index_copy_(0, dst, picks.index_select(0, src))


def read_picks(step: InFlight) -> tuple[list[int], list[int]]:
    """Wait for ``step``'s picks; (tokens, finite flags) per logits row."""
    if step.event is not None:
        step.event.synchronize()
    toks, fins = step.host.tolist()
    return toks, fins


def drop_placeholder(req: Request) -> None:
    if req.pending_tokens:
        req.pending_tokens -= 1


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":  # a pinned source: the copy does not wait for the running step
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
