"""What the completion and chat handlers share: server state, validation, SSE, disconnect handling.

Kept apart from the route wiring so that each endpoint module only says how its request maps to
engine requests and how outputs map back to its response shape.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..engine.errors import ContextLengthError, context_budget
from ..engine.outputs import DeltaAccumulator
from ..engine.sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineRequestError, RequestStream
from .errors import APIError, bad_request, client_error, context_length_exceeded, from_value_error, internal_error
from .metrics import ServerMetrics

MAX_BODY_BYTES = 32 << 20
# a body this large is parsed, tokenized and detokenized on a worker thread: tokenizing megabytes
# takes seconds, and on the event loop that would stall every other client, /health included
OFF_LOOP_BYTES = 64 << 10


@dataclass
class ServerState:
    """Everything a handler needs, created once by :func:`dsv4.serve.app.build_app`."""

    engine: AsyncEngine
    model_names: list[str]
    model_path: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    effort_version: str = "0423"
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get a 413
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def model_name(self, requested: str | None) -> str:
        """The served name to echo back; unknown names are a 404 like OpenAI's."""
        if requested is None or requested in self.model_names or requested == self.model_path:
            return requested or self.model_names[0]
        raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], field_name: str) -> None:
        if not ids:
            raise bad_request(f"{field_name}: the prompt is empty (0 tokens)", param=field_name)
        if 0 <= min(ids) and max(ids) < self.vocab_size:  # C loops: a million ids in milliseconds
            return
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{field_name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              param=field_name)

    def max_tokens(self, prompt_len: int, requested: int | None, field_name: str, prompt_field: str) -> int:
        """The generation budget (the engine's ``context_budget``: the request's, or what is left of
        max_model_len), checked before the request is sent; a request that cannot fit is a 400."""
        try:
            return context_budget(prompt_len, requested, self.max_model_len)
        except ContextLengthError as e:
            raise context_length_exceeded(e, field_name, prompt_field) from None


def sampling_params(build, rename: dict[str, str] | None = None) -> SamplingParams:
    """Call a SamplingParams factory, turning its validation errors into 400s naming the field.

    ``rename`` maps a SamplingParams field to the request field it came from (chat's
    ``top_logprobs`` is SamplingParams.logprobs).
    """
    try:
        return build()
    except ValueError as e:
        err = from_value_error(e)
        err.param = (rename or {}).get(err.param, err.param)
        raise err from None
    except TypeError as e:
        raise bad_request(f"invalid sampling parameters: {e}") from None


def body_bytes(request: Request) -> int:
    """Size of the request's body, as :func:`dsv4.serve.openai_api.parse_body` read it."""
    return request.scope.get("state", {}).get("dsv4_body_bytes", 0)


async def off_loop(request: Request, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: on a worker thread for a large request, inline for a small one.

    Small requests stay inline so that they never wait behind large ones for a pool thread.
    """
    if body_bytes(request) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", param="stream_options")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite(x: float) -> float:
    """JSON has no -inf/NaN: clamp like vLLM does."""
    if x is None:
        return x
    if math.isnan(x):
        return -9999.0
    return max(x, -9999.0)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# the id of the request whose SSE stream is being sent, for its in-band error (set by start_stream;
# the stream's body runs in the task, or a child of the task, that called it)
_stream_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsv4_stream_request_id",
                                                                                 default=None)


def sse_error(e: EngineRequestError | APIError) -> str:
    """The in-band error event of a stream that has started; a 5xx's detail goes to the log only (a public
    one, a shutdown, is sent as it is)."""
    if e.status >= 500 and not getattr(e, "public", False):
        # called in the handler's except block: a handler bug's traceback is worth logging, an engine error's is not
        exc_info = not isinstance(e, EngineRequestError) and sys.exc_info()[1] is not None
        return sse(internal_error(e.status, e.message, _stream_request_id.get(), exc_info=exc_info).body())
    return sse(APIError(e.status, e.message).body())


def log_info(request: Request) -> dict:
    """The dict the request-log middleware prints at the end of the request (id, token counts)."""
    state = request.scope.setdefault("state", {})
    return state.setdefault("dsv4_log", {})


class ClientGone(Exception):
    """The client disconnected before the response could start."""


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def or_disconnect(request: Request, awaitable):
    """Await ``awaitable`` unless the client disconnects first (then raise ClientGone).

    Used while a non-streaming response (or a stream's first output) is pending, so that a client
    that gives up frees its request's pages at once instead of when generation ends.
    """
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    raise ClientGone()


async def last_output(stream: RequestStream):
    """The request's whole output, from its stream's deltas."""
    acc = DeltaAccumulator()
    async for out in stream:
        acc.add(out)
    return acc.result()


async def collect(request: Request, streams: list[RequestStream]) -> list:
    """Final outputs of all streams; aborts them all on disconnect or on the first failure."""
    tasks = [asyncio.ensure_future(last_output(s)) for s in streams]
    try:
        return await or_disconnect(request, asyncio.gather(*tasks))
    except EngineRequestError as e:
        raise client_error(e, log_info(request).get("id")) from None
    finally:
        for s in streams:
            s.abort()
        for t in tasks:
            t.cancel()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams: yields (stream index, output); raises the first error."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream):
        try:
            async for out in s:
                await q.put((i, out))
        except EngineRequestError as e:
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, EngineRequestError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine requests however the stream ends (done, error, disconnect)."""

    def __init__(self, content, streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - already closing
                    pass


async def start_stream(request: Request, streams: list[RequestStream]):
    """Wait for the first output before sending headers, so that a refused request is a plain JSON error.

    Returns ``(first, iterator)`` where ``first`` is the first (index, output) pair.
    """
    rid = log_info(request).get("id")
    _stream_request_id.set(rid)
    it = merged(streams).__aiter__()
    try:
        first = await or_disconnect(request, it.__anext__())
    except EngineRequestError as e:
        for s in streams:
            s.abort()
        raise client_error(e, rid) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return first, it
