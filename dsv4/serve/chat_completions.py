"""/v1/chat/completions: messages → DeepSeek-V4 prompt → engine → reasoning / content / tool calls.

Prompt: :func:`dsv4.chat.render_messages`, tokenized by :meth:`Tokenizer.encode_prompt` (request
text never becomes a control token). Like vLLM, thinking mode with effort "high" is the default;
``chat_template_kwargs`` {thinking | enable_thinking, reasoning_effort} and the top-level
``reasoning_effort`` ("none" → chat mode) change it; the effort text depends on the checkpoint
generation (``effort_version_for_config``).

Output: the streaming :class:`dsv4.chat.DeepseekV4OutputParser` turns text deltas into
``reasoning_content`` (also sent as ``reasoning``), ``content`` and ``tool_calls`` (a first delta
with id and name, then argument fragments). Tool calls are reported only when the request has
tools and ``tool_choice`` is not "none"; DSML markup never reaches the content either way.

``tool_choice``: "auto" (default with tools) lets the model decide; "none" leaves the tools out
of the prompt; "required" and a named function are enforced by a grammar of the DSML tool-call
block (:mod:`dsv4.serve.structured`), which the parser then reads like any other call. A
constrained output (that grammar, ``response_format``, vLLM's ``structured_outputs`` / ``guided_*``)
starts, in thinking mode, with the ``</think>`` that closes an empty reasoning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..chat import DeepseekV4OutputParser, map_reasoning_effort, render_messages
from .errors import APIError, bad_request, from_value_error
from .protocol import ChatCompletionRequest
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


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    thinking: bool
    tools: list[dict] | None  # tool specs given to the parser (schemas drive wrapper unwrapping)
    report_tools: bool  # whether parsed tool calls are returned


def render_chat(state: ServerState, messages, *, tools=None, tool_choice=None, chat_template_kwargs=None,
                reasoning_effort: str | None = None, response_format: dict | None = None) -> ChatPrompt:
    """Render the request's messages with the DeepSeek-V4 encoding (shared with /tokenize)."""
    msgs = [m.model_dump(exclude_none=True) for m in messages]
    kw = chat_template_kwargs.model_dump(exclude_none=True) if chat_template_kwargs is not None else {}
    think = kw.get("thinking", kw.get("enable_thinking"))
    effort = kw.get("reasoning_effort", reasoning_effort)
    mapped_think, mapped_effort = map_reasoning_effort(effort)
    if think is None:
        think = mapped_think
    specs = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    choice = tool_choice if tool_choice is not None else ("auto" if specs else "none")
    try:
        rendered = render_messages(msgs, thinking=bool(think), reasoning_effort=mapped_effort if think else None,
                                   tools=specs if choice != "none" else None, response_format=response_format,
                                   effort_version=state.effort_version)
    except ValueError as e:
        raise from_value_error(e) from None
    return ChatPrompt(rendered.text, state.tokenizer.encode_prompt(rendered), bool(think), specs,
                      report_tools=bool(specs) and choice != "none")


class ChoiceAssembler:
    """Parser state of one choice; turns text deltas into OpenAI chat delta dicts."""

    def __init__(self, prompt: ChatPrompt):
        self.parser = DeepseekV4OutputParser(thinking=prompt.thinking, tools=prompt.tools)
        self.report_tools = prompt.report_tools
        self.num_tool_calls = 0
        self.done = False
        self.pending_logprobs: list = []

    def _convert(self, deltas) -> list[dict]:
        out = []
        for d in deltas:
            if d.reasoning_content is not None:
                out.append({"reasoning_content": d.reasoning_content, "reasoning": d.reasoning_content})
            if d.content is not None:
                out.append({"content": d.content})
            if d.tool_call_index is None or not self.report_tools:
                continue
            if d.tool_call_id is not None or d.tool_name is not None:
                self.num_tool_calls += 1
                out.append({"tool_calls": [{"index": d.tool_call_index, "id": d.tool_call_id, "type": "function",
                                            "function": {"name": d.tool_name, "arguments": d.arguments_delta or ""}}]})
            elif d.arguments_delta:
                out.append({"tool_calls": [{"index": d.tool_call_index, "function": {"arguments": d.arguments_delta}}]})
        return out

    def feed(self, text: str) -> list[dict]:
        return self._convert(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._convert(self.parser.finish())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.num_tool_calls else engine_reason


def fold(deltas: list[dict]) -> dict:
    """Accumulate delta dicts into one assistant message."""
    content, reasoning, calls = [], [], {}
    for d in deltas:
        content.append(d.get("content") or "")
        reasoning.append(d.get("reasoning_content") or "")
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"],
                                 {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            if tc.get("id"):
                c["id"] = tc["id"]
            fn = tc.get("function", {})
            if fn.get("name"):
                c["function"]["name"] = fn["name"]
            c["function"]["arguments"] += fn.get("arguments") or ""
    text, think = "".join(content), "".join(reasoning)
    tool_calls = [calls[i] for i in sorted(calls)]
    return {
        "role": "assistant",
        "content": None if (not text and tool_calls) else text,
        "reasoning_content": think or None,
        "reasoning": think or None,
        "tool_calls": tool_calls,
    }


def chat_logprobs(tok, token_ids, dicts, top_n: int) -> list[dict]:
    out = []
    for tid, d in zip(token_ids, dicts):
        d = d or {}

        def name(t, lp):
            return lp.decoded_token if lp is not None and lp.decoded_token is not None else tok.decode([t])

        entry = d.get(tid)
        s = name(tid, entry)
        tops = sorted(
            ((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= top_n), key=lambda kv: kv[1].rank
        )[:top_n]
        out.append(
            {
                "token": s,
                "logprob": finite(entry.logprob) if entry is not None else None,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": name(t, lp), "logprob": finite(lp.logprob), "bytes": list(name(t, lp).encode("utf-8"))}
                    for t, lp in tops
                ],
            }
        )
    return out


async def create_chat_completion(request: Request, state: ServerState, req: ChatCompletionRequest):
    model = state.model_name(req.model)
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
    prompt = await off_loop(
        request,
        render_chat,
        state,
        req.messages,
        tools=req.tools,
        tool_choice=req.tool_choice,
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning_effort,
        response_format=req.response_format,
    )
    state.check_prompt(prompt.ids, "messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = state.max_tokens(len(prompt.ids), requested, field, "messages")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    constraint = await off_loop(request, output_constraint, req, thinking=prompt.thinking)
    bias = token_bias(req.logit_bias, state.vocab_size)
    params = sampling_params(
        lambda: req.sampling_params(max_tokens, state.generation_defaults, logprobs=top_n,
                                    structured_outputs=constraint, logit_bias=bias),
        rename={"logprobs": "top_logprobs", "max_tokens": field},
    )
    rid = new_id("chatcmpl")
    info = log_info(request)
    info.update(id=rid, prompt_tokens=len(prompt.ids), completion_tokens=0)
    stream = state.engine.add_request(prompt.ids, params, prompt=prompt.text, request_id=rid)
    tok = state.tokenizer
    created = int(time.time())

    if not req.stream:
        (out,) = await collect(request, [stream])
        choices, n_completion = [], 0
        for o in out.outputs:
            asm = ChoiceAssembler(prompt)
            deltas = asm.feed(o.text) + asm.finish()
            n_completion += len(o.token_ids)
            choices.append(
                {
                    "index": o.index,
                    "message": fold(deltas),
                    "logprobs": {"content": chat_logprobs(tok, o.token_ids, o.logprobs or [], top_n)}
                    if req.logprobs
                    else None,
                    "finish_reason": asm.finish_reason(o.finish_reason),
                    "stop_reason": o.stop_reason,
                }
            )
        info["completion_tokens"] = n_completion
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(len(prompt.ids), n_completion),
            }
        )

    first, it = await start_stream(request, [stream])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(idx: int, delta: dict, finish_reason=None, logprobs=None) -> str:
        return sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": idx,
                        "delta": delta,
                        "logprobs": {"content": logprobs} if logprobs is not None else None,
                        "finish_reason": finish_reason,
                    }
                ],
            }
        )

    async def events():
        asms: dict[int, ChoiceAssembler] = {}

        def handle(out):
            for o in out.outputs:
                a = asms.get(o.index)
                if a is None:
                    a = asms[o.index] = ChoiceAssembler(prompt)
                    yield chunk(o.index, {"role": "assistant", "content": ""})
                if a.done:
                    continue
                if req.logprobs:  # (the output is a delta: this step's tokens only)
                    a.pending_logprobs += chat_logprobs(tok, o.token_ids, o.logprobs or [], top_n)
                deltas = a.feed(o.text)
                if o.finish_reason is not None:
                    deltas += a.finish()
                for d in deltas:
                    lp, a.pending_logprobs = (a.pending_logprobs or None), []
                    yield chunk(o.index, d, logprobs=lp)
                if o.finish_reason is not None:
                    a.done = True
                    lp, a.pending_logprobs = (a.pending_logprobs or None), []
                    yield chunk(o.index, {}, finish_reason=a.finish_reason(o.finish_reason), logprobs=lp)

        n_tokens: dict[int, int] = {}

        def count(out) -> None:
            for o in out.outputs:
                n_tokens[o.index] = n_tokens.get(o.index, 0) + len(o.token_ids)
            info["completion_tokens"] = sum(n_tokens.values())

        complete = False
        try:
            count(first[1])
            for s in handle(first[1]):
                yield s
            async for _, out in it:
                count(out)
                for s in handle(out):
                    yield s
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(len(prompt.ids), info["completion_tokens"]),
                    }
                )
            complete = True
        except Exception as e:  # noqa: BLE001 - the stream has started: report the error in-band
            complete = True
            info["status_override"] = getattr(e, "status", 500)
            yield sse_error(e if hasattr(e, "status") else APIError(500, f"{type(e).__name__}: {e}"))
        finally:
            if not complete:  # the client went away mid-stream
                info.setdefault("status_override", 499)
        yield sse("[DONE]")

    return EngineStreamingResponse(events(), [stream])
