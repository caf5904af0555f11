"""Token sampling: penalties, logit bias, grammar masks, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Each request's row is processed on its own, so a token never depends on the batch it was
sampled in. Greedy picks the lowest token id among equal maxima. Plain greedy rows (no penalties,
bans, bias, grammar or logprobs) are picked where the logits are, in one batched pick (`greedy_picks`), so a
decode step copies a few ids to the host instead of [batch, vocab] logits. Logprobs are those of the
model's raw distribution (before penalties, bias, grammar masks and temperature), as vLLM reports them.
"""

from __future__ import annotations

import torch

from .errors import GrammarError, NonFiniteLogitsError
from .outputs import Logprob
from .request import Request
from .structured import apply_bitmask


def _first_argmax(x: torch.Tensor) -> int:
    return int(torch.nonzero(x == x.max())[0, 0])


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        ids, counts = torch.unique(torch.tensor(req.output_token_ids, dtype=torch.long), return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    ids = torch.tensor(list(bias), dtype=torch.long)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = (cum - probs) >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def top_logprobs(logprobs: torch.Tensor, token: int, n: int, decode=None) -> dict[int, Logprob]:
    """The sampled token's logprob plus the top ``n`` (ranks are 1-based, as in vLLM)."""
    out: dict[int, Logprob] = {}
    rank = int((logprobs > logprobs[token]).sum()) + 1
    out[token] = Logprob(float(logprobs[token]), rank, decode(token) if decode else None)
    if n > 0:
        vals, ids = torch.topk(logprobs, n)
        for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            if i not in out:
                out[i] = Logprob(v, r, decode(i) if decode else None)
    return out


def plain_greedy(req: Request) -> bool:
    """Whether ``req``'s next token is just the first argmax of its raw logits (no penalties, EOS or
    stop-id bans, logit bias, grammar, logprobs): the rows `greedy_picks` may pick on the device."""
    return req.params.greedy and plain(req)


def plain(req: Request) -> bool:
    """Whether ``req``'s next token depends only on its raw logits row and its temperature, top-k,
    top-p and min-p (no penalties, EOS or stop-id bans, logit bias, grammar, logprobs): rows that can
    be sampled on the device (``device_dists``) — each row's distribution is then the same whatever
    tokens came before it in the step."""
    p = req.params
    return (p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and not p.adjusts_logits and req.num_output_tokens >= p.min_tokens)


def device_dists(x: torch.Tensor, settings: torch.Tensor) -> torch.Tensor:
    """fp32 [n, V] on ``x``'s device: each row's sampling distribution, the softmax of
    ``filter_logits(row / temperature, top_k, top_p, min_p)`` (the host sampler's), for rows x [n, V]
    with ``settings`` [n, 4] = (temperature, top_k (0: off), top_p, min_p); a row of temperature 0 (a
    greedy lane) gets a distribution nobody reads. Fixed shapes, no host sync
    (CUDA-graph capturable): the filters act on one descending stable sort of each row."""
    t, top_k, top_p, min_p = (settings[:, i:i + 1].to(torch.float32) for i in range(4))
    s, order = torch.sort(x.float() / t.clamp(min=1e-6), dim=-1, descending=True, stable=True)
    v = s.shape[1]
    kth = s.gather(1, (top_k.long().clamp(1, v) - 1))
    s = s.masked_fill((top_k > 0) & (top_k < v) & (s < kth), float("-inf"))
    pr = torch.softmax(s, dim=-1)
    s = s.masked_fill((min_p > 0) & (pr < min_p * pr[:, :1]), float("-inf"))
    pr = torch.softmax(s, dim=-1)
    s = s.masked_fill((top_p < 1.0) & ((torch.cumsum(pr, dim=-1) - pr) >= top_p), float("-inf"))
    return torch.empty_like(pr).scatter_(1, order, torch.softmax(s, dim=-1))


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 [n]: a draw from each row of p [n, V] (non-negative, not necessarily normalized) for
    uniforms u [n] in [0, 1): the first token whose cumulative mass exceeds u × the row's mass (a
    token of zero mass is never drawn)."""
    cdf = torch.cumsum(p.double(), dim=-1)
    return (cdf <= u.double()[:, None] * cdf[:, -1:]).sum(-1).clamp(max=p.shape[1] - 1)


def device_picks(x: torch.Tensor, pick=None) -> torch.Tensor:
    """int64 [2, n] on ``x``'s device: each row's first-argmax token (the lowest id among equal
    maxima, as `_first_argmax` gives) and whether the row is all finite. ``pick``: the engine's
    ``greedy_pick`` backend (None: the torch op)."""
    if pick is None:
        from ..ops.torch_ops import greedy_pick as pick
    return pick(x)


def greedy_picks(logits: torch.Tensor, rows: list[int], pick=None) -> dict[int, int]:
    """{row: first-argmax token} for the finite ``rows`` of ``logits`` [n, V] (``device_picks``,
    one small copy back); rows with NaN/Inf are left out (the per-row path reports them)."""
    if not rows:
        return {}
    # a decode step samples every row: no index copy to the device, no gather
    x = (
        logits
        if rows == list(range(logits.shape[0]))
        else logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
    )
    both = device_picks(x, pick).tolist()
    return {r: t for r, t, ok in zip(rows, both[0], both[1]) if ok}


class Sampler:
    batched_greedy = True  # the engine may pick plain greedy rows with greedy_picks (wrappers that
    #                        must see every request set this False)

    def __init__(self, eos_token_id: int, seed: int = 0, decode=None):
        self.eos = eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.decode = decode

    def sample(self, req: Request, logits: torch.Tensor,
               mask: torch.Tensor | None = None) -> tuple[int, dict[int, Logprob] | None, float | None]:
        """Pick the next token of ``req`` from its logits row [V] (float32); ``mask``: the
        allowed-token bitmask of its grammar (int32 [ceil(V/32)]), if it has one."""
        raw = self.checked(req, logits)
        token = self.draw(req, self.target_logits(req, raw, mask))
        lp, token_lp = self.logprobs(req, raw, token)
        return token, lp, token_lp

    @staticmethod
    def checked(req: Request, logits: torch.Tensor) -> torch.Tensor:
        """The row as float32; a non-finite one fails the request, naming it."""
        raw = logits.float()
        if not torch.isfinite(raw).all():
            raise NonFiniteLogitsError.at(req.request_id, len(req.output_token_ids))
        return raw

    def target_logits(self, req: Request, raw: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the next token is drawn from: ``raw`` with the penalties, the min_tokens bans,
        the logit bias and the grammar mask applied, then (when sampling) divided by the temperature
        and filtered by top-k, min-p and top-p. Greedy takes its first argmax, sampling its softmax."""
        p = req.params
        x = apply_penalties(raw.clone(), req)
        if len(req.output_token_ids) < p.min_tokens:  # EOS and stop ids may not end the output yet
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else [self.eos])
            x[banned] = float("-inf")
        if p.logit_bias:
            x = apply_logit_bias(x, p.logit_bias)
        if mask is not None:
            x = apply_bitmask(x[None], mask[None])[0]
            if not torch.isfinite(x).any():
                raise GrammarError.of(
                    req.request_id,
                    f"the structured output's grammar allows no token at output token {len(req.output_token_ids)} "
                    f"(with min_tokens={p.min_tokens}, EOS and the stop ids are banned until then)",
                )
        if p.greedy:
            return x
        return filter_logits(x / p.temperature, p.top_k, p.top_p, p.min_p)

    def generator_of(self, req: Request) -> torch.Generator:
        return req.generator or self.generator

    def draw(self, req: Request, x: torch.Tensor) -> int:
        """A token from ``target_logits``: the first argmax (greedy), else a seeded draw."""
        if req.params.greedy:
            return _first_argmax(x)
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=self.generator_of(req)))

    def logprobs(self, req: Request, raw: torch.Tensor, token: int) -> tuple[dict[int, Logprob] | None, float | None]:
        """The logprobs a request asked for, of the raw distribution."""
        if req.params.logprobs is None:
            return None, None
        logprobs = torch.log_softmax(raw, dim=-1)
        return top_logprobs(logprobs, token, req.params.logprobs, self.decode), float(logprobs[token])

    def prompt_logprobs(self, req: Request, logits: torch.Tensor) -> list:
        """Logprobs of prompt tokens 1.. given the logits of rows 0..n-2 (first entry None)."""
        n = req.params.prompt_logprobs
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out: list = [None]
        for i, tok in enumerate(req.prompt_token_ids[1:]):
            out.append(top_logprobs(logprobs[i], tok, n, self.decode))
        return out
