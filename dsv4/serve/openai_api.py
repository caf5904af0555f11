"""HTTP routes and middleware: parse and authenticate requests, dispatch to the endpoint modules, log.

Bodies are parsed here by hand (not by FastAPI's signature binding) so that malformed JSON and
wrong field types get one consistent OpenAI-style 400 with the field named.
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .. import __version__
from .chat_completions import create_chat_completion, render_chat
from .completions import create_completion
from .errors import APIError, bad_request, from_validation_error
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import ClientGone, ServerState

log = logging.getLogger("dsv4.serve")

router = APIRouter()

# paths that never need the API key (probes and scrapes)
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")
KNOWN_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
                   "/ping", "/version", "/metrics")


def _state(request: Request) -> ServerState:
    return request.app.state.dsv4


async def parse_body(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


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


@router.post("/tokenize")
async def tokenize(request: Request):
    st = _state(request)
    req = await parse_body(request, TokenizeRequest)
    st.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        ids = st.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        # the rendered conversation starts with BOS already; add_special_tokens does not add another
        ids = render_chat(st, req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs).ids
    out = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [st.tokenizer.id_to_token(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(request: Request):
    st = _state(request)
    req = await parse_body(request, DetokenizeRequest)
    st.model_name(req.model)
    st.check_prompt(req.tokens or [0], "tokens")
    return {"prompt": st.tokenizer.decode(req.tokens)}


@router.get("/health")
async def health(request: Request):
    st = _state(request)
    if not st.engine.alive:  # why is in the log (this path needs no API key)
        raise APIError(503, "engine not running; see the server log")
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
    """One log line and one counter increment per request, when its response has fully ended.

    A pure ASGI middleware (not BaseHTTPMiddleware) so that streaming responses are timed to their
    last byte and a disconnect is still logged.
    """

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

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
            endpoint = path if path in KNOWN_ENDPOINTS else "other"
            self.metrics.http(endpoint, code)
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
