"""HTTP routes and middleware: parse and authenticate requests, dispatch to the endpoint modules, log.

Bodies are parsed here by hand (not by FastAPI's signature binding) so that malformed JSON and
wrong field types get one consistent OpenAI-style 400 with the field named, and so that what the
decoder accepts but nothing after it can handle (deep nesting, lone surrogates) is refused first.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .. import __version__
from .chat_completions import create_chat_completion, render_chat
from .completions import create_completion
from .errors import APIError, bad_request, field_path, from_validation_error
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import OFF_LOOP_BYTES, ClientGone, ServerState, off_loop

log = logging.getLogger("dsv4.serve")

router = APIRouter()

# paths that never need the API key (probes and scrapes)
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")
KNOWN_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
                   "/ping", "/version", "/metrics")


def _state(request: Request) -> ServerState:
    return request.app.state.dsv4


# Deeper JSON parses (Python's decoder stops near 1,000 levels with a RecursionError), but copying
# and rendering it recurses too (deepcopy of a 500-level tool schema fails); no real request nests
# a tenth as deep.
MAX_JSON_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only such an escape can put one in a str
_SURROGATE = re.compile("[\ud800-\udfff]")
_WS = re.compile(r"[ \t\n\r]*")


def check_content_type(request: Request) -> None:
    """JSON or nothing (curl and many scripts send no Content-Type), as FastAPI's body binding has it."""
    ctype = request.headers.get("content-type")
    if not ctype:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise bad_request(f"Content-Type must be application/json, got {ctype!r}", code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; a 413 as soon as it is known to be over ``limit`` bytes (it is not buffered further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"Request body too large: {size}, the limit is {limit} bytes ({limit / 2**20:g} MiB)",
                    code="request_too_large")


def _too_deep_field(text: str) -> str | None:
    """The top-level key whose value the decoder could not parse for its depth (best effort)."""
    dec = json.JSONDecoder()
    i = _WS.match(text).end()
    if text[i:i + 1] != "{":
        return None
    i += 1
    try:
        while True:
            i = _WS.match(text, i).end()
            if text[i:i + 1] != '"':
                return None
            key, i = json.decoder.scanstring(text, i + 1)
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ":":
                return None
            try:
                _, i = dec.raw_decode(text, _WS.match(text, i + 1).end())
            except RecursionError:
                return key
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ",":
                return None
            i += 1
    except ValueError:
        return None


def _scan(data: dict, surrogates: bool) -> APIError | None:
    """A 400 naming a value nested deeper than MAX_JSON_DEPTH or holding a lone surrogate, if there is one.

    Iterative, so that it cannot itself run out of stack; it only looks at strings when the body
    had a surrogate escape at all.
    """
    stack = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            where = field_path(path)
            return bad_request(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep", param=where)
        for k, v in value.items() if type(value) is dict else enumerate(value):
            if surrogates and ((type(k) is str and _SURROGATE.search(k)) or (type(v) is str and _SURROGATE.search(v))):
                where = field_path(path + (k,))
                return bad_request(f"{where}: contains a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape outside "
                                   "a pair), which is not valid Unicode", param=where)
            if type(v) is dict or type(v) is list:
                stack.append((v, depth + 1, path + (k,)))
    return None


def decode_body(raw: bytes, model):
    """Bytes → a validated ``model``, or the APIError (a 400) that names what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"Invalid JSON body: not UTF-8 (byte 0x{raw[e.start]:02x} at position {e.start})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        where = _too_deep_field(text)
        raise bad_request(f"{where or 'Invalid JSON body'}: nested more than {MAX_JSON_DEPTH} levels deep",
                          param=where) from None
    except ValueError as e:
        raise bad_request(f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}")
    err = _scan(data, surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    if err is not None:
        raise err
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def parse_body(request: Request, model):
    check_content_type(request)
    raw = await read_body(request, _state(request).max_body_bytes)
    request.scope.setdefault("state", {})["dsv4_body_bytes"] = len(raw)
    if len(raw) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode_body, raw, model)
    return decode_body(raw, model)


def _client_gone() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": for the log and metrics only


@router.get("/v1/models")
async def list_models(request: Request):
    st = _state(request)
    data = [{"id": name, "object": "model", "created": st.created, "owned_by": "dsv4", "root": st.model_path,
             "parent": None, "max_model_len": st.max_model_len, "permission": []} for name in st.model_names]
    return {"object": "list", "data": data}


@router.post("/v1/completions")
async def completions(request: Request):
    req = await parse_body(request, CompletionRequest)
    try:
        return await create_completion(request, _state(request), req)
    except ClientGone:
        return _client_gone()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    req = await parse_body(request, ChatCompletionRequest)
    try:
        return await create_chat_completion(request, _state(request), req)
    except ClientGone:
        return _client_gone()


def _tokenize(st: ServerState, req: TokenizeRequest) -> dict:
    if req.prompt is not None:
        ids = st.tokenizer.encode(req.prompt, req.add_special_tokens is not False)
    else:
        # the rendered conversation starts with BOS already; add_special_tokens does not add another
        ids = render_chat(st, req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs).ids
    out = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [st.tokenizer.id_to_token(t) for t in ids]
    return out


@router.post("/tokenize")
async def tokenize(request: Request):
    st = _state(request)
    req = await parse_body(request, TokenizeRequest)
    st.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    return await off_loop(request, _tokenize, st, req)


def _detokenize(st: ServerState, req: DetokenizeRequest) -> dict:
    st.check_prompt(req.tokens or [0], "tokens")
    return {"prompt": st.tokenizer.decode(req.tokens)}


@router.post("/detokenize")
async def detokenize(request: Request):
    st = _state(request)
    req = await parse_body(request, DetokenizeRequest)
    st.model_name(req.model)
    return await off_loop(request, _detokenize, st, req)


@router.get("/health")
async def health(request: Request):
    problem = _state(request).engine.health()  # (no engine internals: this path needs no API key)
    if problem:
        raise APIError(503, problem)
    return Response(status_code=200)


@router.get("/ping")
async def ping(request: Request):
    return await health(request)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request):
    st = _state(request)
    return Response(st.metrics.render(), media_type=st.metrics.content_type)


class AuthMiddleware:
    """``Authorization: Bearer <key>`` on every path but the probes, when the server has an API key."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                msg = "Missing API key" if not auth else "Incorrect API key provided"
                resp = JSONResponse(APIError(401, msg + " (send 'Authorization: Bearer <key>')",
                                             code="invalid_api_key").body(), status_code=401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestLogMiddleware:
    """One log line per request, when its response has fully ended (``HTTPMetricsMiddleware`` counts them).

    A pure ASGI middleware (not BaseHTTPMiddleware) so that streaming responses are timed to their
    last byte and a disconnect is still logged.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = [500]
        info = scope.setdefault("state", {}).setdefault("dsv4_log", {})

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope["path"]
            code = info.get("status_override", status[0])
            level = logging.DEBUG if path in OPEN_PATHS else logging.INFO
            if log.isEnabledFor(level):
                extra = ""
                if "prompt_tokens" in info:
                    extra = (f" prompt_tokens={info['prompt_tokens']} "
                             f"completion_tokens={info.get('completion_tokens', 0)}")
                log.log(
                    level,
                    "request id=%s %s %s status=%s%s latency=%.3fs",
                    info.get("id", "-"),
                    scope.get("method"),
                    path,
                    code,
                    extra,
                    time.monotonic() - start,
                )
