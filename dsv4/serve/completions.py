"""/v1/completions: prompts (text or token ids, one or many) → engine requests → OpenAI text completions.

``echo`` + ``logprobs`` returns prompt logprobs (the engine's ``prompt_logprobs``), which is what
lm-eval's loglikelihood requests use; ``max_tokens=0`` with ``echo`` scores the prompt only (the
engine needs at least one token, so one is generated and dropped). ``response_format``,
``structured_outputs``, ``guided_*`` and ``logit_bias`` as on chat (:mod:`dsv4.serve.structured`),
without the chat's ``</think>``: a raw prompt has no reasoning.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import APIError, bad_request
from .protocol import CompletionRequest
from .serving import (
    EngineStreamingResponse,
    ServerState,
    check_stream_options,
    collect,
    finite,
    log_info,
    new_id,
    off_loop,
    sampling_params,
    sse,
    sse_error,
    start_stream,
    usage,
)
from .structured import output_constraint, token_bias


def _prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt."""
    p = req.prompt
    tok = state.tokenizer
    if isinstance(p, str):
        items = [(p, tok.encode(p, req.add_special_tokens))]
    elif not p:
        raise bad_request("prompt: must not be empty", param="prompt")
    elif isinstance(p[0], int):
        items = [(None, list(p))]
    elif isinstance(p[0], str):
        items = [(s, tok.encode(s, req.add_special_tokens)) for s in p]
    else:
        items = [(None, list(ids)) for ids in p]
    for i, (_, ids) in enumerate(items):
        state.check_prompt(ids, "prompt" if len(items) == 1 else f"prompt[{i}]")
    return items


def _logprobs_block(tok, token_ids, dicts, offset: int) -> tuple[dict, int]:
    """Legacy completions logprobs for a run of tokens; returns it and the text offset after it."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, dicts):
        entry = d.get(tid) if d else None
        text = entry.decoded_token if entry is not None and entry.decoded_token is not None else tok.decode([tid])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if not d:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(finite(entry.logprob) if entry is not None else None)
        top = {}
        for t, lp in sorted(d.items(), key=lambda kv: (kv[1].rank or 0)):
            key = lp.decoded_token if lp.decoded_token is not None else tok.decode([t])
            top.setdefault(key, finite(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _join(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


async def create_completion(request: Request, state: ServerState, req: CompletionRequest):
    model = state.model_name(req.model)
    check_stream_options(req)
    if req.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if req.max_tokens is not None and req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens: must be at least 1 (0 is only allowed with echo)", param="max_tokens")
    echo_only = req.echo and req.max_tokens == 0
    prompts = await off_loop(request, _prompts, state, req)
    want_lp = req.logprobs is not None
    constraint = await off_loop(request, output_constraint, req)
    bias = token_bias(req.logit_bias, state.vocab_size)
    subs = []
    for i, (text, ids) in enumerate(prompts):
        pf = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        max_tokens = state.max_tokens(len(ids), 1 if echo_only else req.max_tokens, "max_tokens", pf)
        params = sampling_params(lambda: req.sampling_params(
            max_tokens, state.generation_defaults, logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if (req.echo and want_lp) else None, structured_outputs=constraint,
            logit_bias=bias), rename={"prompt_logprobs": "logprobs"})
        subs.append((text, ids, params))
    rid = new_id("cmpl")
    info = log_info(request)
    info.update(id=rid, prompt_tokens=sum(len(ids) for _, ids, _ in subs), completion_tokens=0)
    streams = [state.engine.add_request(ids, params, prompt=text, request_id=f"{rid}-{i}")
               for i, (text, ids, params) in enumerate(subs)]
    n = req.n
    tok = state.tokenizer
    created = int(time.time())

    def prompt_text(i: int) -> str:
        text, ids, _ = subs[i]
        return text if text is not None else tok.decode(ids)

    def prompt_lp(i: int, out) -> tuple[dict | None, int]:
        if not (req.echo and want_lp):
            return None, 0
        ids = subs[i][1]
        dicts = out.prompt_logprobs or [None] * len(ids)
        return _logprobs_block(tok, ids, dicts, 0)

    def gen(o):
        """(text, token ids, logprob dicts) of a choice, hiding the one token of an echo-only request."""
        if echo_only:
            return "", [], []
        return o.text, o.token_ids, (o.logprobs or [])

    if not req.stream:
        outs = await collect(request, streams)
        choices, n_completion = [], 0
        for i, out in enumerate(outs):
            for o in out.outputs:
                text, ids, dicts = gen(o)
                n_completion += len(ids)
                lp = None
                if want_lp:
                    lp, off = prompt_lp(i, out)
                    body, _ = _logprobs_block(tok, ids, dicts, off if lp else 0)
                    lp = _join(lp, body)
                choices.append({
                    "index": i * n + o.index,
                    "text": (prompt_text(i) if req.echo else "") + text,
                    "logprobs": lp,
                    "finish_reason": "length" if echo_only else o.finish_reason,
                    "stop_reason": None if echo_only else o.stop_reason,
                })
        info["completion_tokens"] = n_completion
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": usage(info["prompt_tokens"], n_completion),
        })

    first, it = await start_stream(request, streams)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        sent: dict[int, list] = {}  # choice index → [text offset, finished]
        n_completion = {}

        def chunks_for(i: int, out):
            for o in out.outputs:
                idx = i * n + o.index
                st = sent.get(idx)
                prefix, lp = "", None
                if st is None and req.echo and want_lp and out.prompt_logprobs is None and not out.finished:
                    continue  # chunked prefill still running: echo once the prompt logprobs exist
                if st is None:
                    st = sent[idx] = [0, False]
                    if req.echo:
                        prefix = prompt_text(i)
                        lp, st[0] = prompt_lp(i, out)
                if st[1]:
                    continue
                delta, new_ids, dicts = gen(o)  # (the output is a delta: this step's text and tokens)
                if want_lp:
                    body, st[0] = _logprobs_block(tok, new_ids, dicts, st[0])
                    lp = _join(lp, body)
                n_completion[idx] = n_completion.get(idx, 0) + len(new_ids)
                info["completion_tokens"] = sum(n_completion.values())
                done = o.finish_reason is not None
                if not (prefix or delta or new_ids or done):
                    continue
                st[1] = done
                yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": idx, "text": prefix + delta, "logprobs": lp,
                                    "finish_reason": ("length" if echo_only else o.finish_reason) if done else None,
                                    "stop_reason": None if echo_only or not done else o.stop_reason}]}

        complete = False
        try:
            for chunk in chunks_for(*first):
                yield sse(chunk)
            async for i, out in it:
                for chunk in chunks_for(i, out):
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(info["prompt_tokens"], info["completion_tokens"])})
            complete = True
        except Exception as e:  # noqa: BLE001 - report in-band; the stream has started
            complete = True
            info["status_override"] = getattr(e, "status", 500)
            yield sse_error(e if hasattr(e, "status") else APIError(500, f"{type(e).__name__}: {e}"))
        finally:
            if not complete:  # the client went away mid-stream
                info.setdefault("status_override", 499)
        yield sse("[DONE]")

    return EngineStreamingResponse(events(), streams)
