"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching status.

Every failure a client can cause is raised as :class:`APIError` (or converted into one here), so
that handlers never leak a traceback and a bad request can never take the server down. A 5xx
body says only which request failed (:func:`internal_error`); what failed goes to the server log.
"""

from __future__ import annotations

import logging
import re
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.errors import ContextLengthError

log = logging.getLogger("dsv4.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        # a lone surrogate taken from the request (JSON's \ud800 escape) would make the body unencodable
        message, param = _encodable(message), _encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _encodable(text: str | None) -> str | None:
    return text if text is None or text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def request_id(request) -> str:
    """The request's id as the request log prints it (the response id once a handler set one)."""
    info = request.scope.setdefault("state", {}).setdefault("dsv4_log", {})
    return info.setdefault("id", f"req-{uuid.uuid4().hex}")


def internal_error(status: int, detail: str, rid: str | None, *, exc_info=None) -> APIError:
    """The 5xx a client gets: which request failed, and that the log says why.

    ``detail`` (exception text: library source paths, peer addresses, pieces of other requests'
    state) is for the operator, so it is logged with the id instead of sent.
    """
    rid = rid or f"req-{uuid.uuid4().hex}"
    log.error("request %s failed with status %d: %s", rid, status, detail, exc_info=exc_info)
    if status == 503:
        return APIError(status, f"service unavailable: request {rid} could not be run; see the server log")
    return APIError(status, f"internal error while running request {rid}; see the server log")


def client_error(e, rid: str | None) -> APIError:
    """An EngineRequestError or APIError as the client may see it: a 4xx (or a public 5xx: a shutdown) as
    is, any other 5xx by :func:`internal_error`."""
    if e.status >= 500 and not getattr(e, "public", False):
        return internal_error(e.status, e.message, rid)
    if isinstance(e, APIError):
        return e
    return APIError(e.status, e.message)


def from_value_error(e: ValueError) -> APIError:
    """A ValueError from SamplingParams / the encoder / the engine: its text already names the field."""
    msg = str(e)
    m = re.match(r"SamplingParams\.(\w+)", msg) or re.match(r"(messages\[\d+\](?:\.\w+)*)", msg) \
        or re.match(r"(tools|reasoning_effort|response_format)\b", msg)
    return bad_request(msg, param=m.group(1) if m else None)


def context_length_exceeded(e: ContextLengthError, field_name: str, prompt_field: str) -> APIError:
    """The engine's ``ContextLengthError`` as OpenAI words it: the prompt alone too long, or with the
    completion (``field_name``: the request's max_tokens field, ``prompt_field``: its prompt's)."""
    L, n, m = e.max_model_len, e.prompt_len, e.max_tokens
    if e.prompt_too_long:
        return bad_request(
            f"This model's maximum context length is {L} tokens. However, your prompt has {n} tokens, "
            f"which leaves no room for the completion. Please reduce the length of the {prompt_field}.",
            param=prompt_field, code="context_length_exceeded")
    return bad_request(
        f"This model's maximum context length is {L} tokens. However, you requested {n + m} "
        f"tokens ({n} in the {prompt_field}, {m} in the completion). Please reduce the "
        f"length of the {prompt_field} or {field_name}.", param=field_name, code="context_length_exceeded")


def field_path(loc) -> str:
    """``("messages", 0, "content")`` → ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """Pydantic errors → one 400 whose message lists each bad field as ``path: problem``."""
    errs = e.errors()
    parts, first = [], None
    for err in errs[:5]:
        # union members add their type name to the location ("prompt.str"); drop those
        loc = [p for p in err.get("loc", ()) if p != "body" and not (isinstance(p, str) and (
            p in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "function-after")
            or p.startswith(("list[", "literal[", "dict[")) or p[:1].isupper()))]
        path = field_path(loc) or "body"
        first = first or path
        parts.append(f"{path}: {err.get('msg', 'invalid value')}")
    more = f" (and {len(errs) - 5} more)" if len(errs) > 5 else ""
    return bad_request("Invalid request: " + "; ".join(dict.fromkeys(parts)) + more, param=first)


def install_handlers(app) -> None:
    """Map every exception to the OpenAI error shape (404/405 of unknown routes included)."""

    from .async_engine import EngineRequestError

    @app.exception_handler(APIError)
    async def _api(_req: Request, e: APIError):
        return e.response()

    @app.exception_handler(EngineRequestError)
    async def _engine(req: Request, e: EngineRequestError):
        return client_error(e, request_id(req)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError):
        return from_validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def _unhandled(req: Request, e: Exception):
        detail = f"unhandled error on {req.url.path}: {type(e).__name__}: {e}"
        response = internal_error(500, detail, request_id(req), exc_info=e).response()
        # Starlette re-raises after this response and uvicorn then drops the connection: say so, or a
        # client reusing it for its next request gets a reset
        response.headers["Connection"] = "close"
        return response
