"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching status.

Every failure a client can cause is raised as :class:`APIError` (or converted into one here), so
that handlers never leak a traceback and a bad request can never take the server down.
"""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("dsv4.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(e: ValueError) -> APIError:
    """A ValueError from SamplingParams / the encoder / the engine: its text already names the field."""
    msg = str(e)
    m = re.match(r"SamplingParams\.(\w+)", msg) or re.match(r"(messages\[\d+\](?:\.\w+)*)", msg) \
        or re.match(r"(tools|reasoning_effort|response_format)\b", msg)
    return bad_request(msg, param=m.group(1) if m else None)


def _loc(loc) -> str:
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
        path = _loc(loc) or "body"
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
    async def _engine(_req: Request, e: EngineRequestError):
        return APIError(e.status, e.message).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError):
        return from_validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def _unhandled(req: Request, e: Exception):
        log.exception("unhandled error on %s", req.url.path)
        return APIError(500, f"internal server error: {type(e).__name__}: {e}").response()
