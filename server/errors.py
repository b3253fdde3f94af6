"""Typed API errors and the handlers that render every failure in the OpenAI/vLLM shape.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": int}}`` where
``type`` is a class-like name (``BadRequestError``, ``NotFoundError``, ...) and ``code`` the
HTTP status, so one parser handles both us and vLLM.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("specserve.server")

_TYPE_NAMES = MappingProxyType({
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
})


def error_type(status: int) -> str:
    if status in _TYPE_NAMES:
        return _TYPE_NAMES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


class APIError(Exception):
    """An error that becomes an HTTP response (or a final SSE ``error`` event)."""

    status: int = 500

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401


class NotFoundError(APIError):
    status = 404


class RequestTimeoutError(APIError):
    status = 408


class PayloadTooLargeError(APIError):
    status = 413


class UnsupportedMediaTypeError(APIError):
    status = 415


class InternalServerError(APIError):
    status = 500


class GatewayTimeoutError(APIError):
    """A request that ran past ``--request-timeout`` after it had started generating."""

    status = 504


class ServiceUnavailableError(APIError):
    """Overloaded, still starting, draining or with a dead engine: retry elsewhere/later."""

    status = 503

    def __init__(self, message: str, retry_after: int | None = 1) -> None:
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        super().__init__(message, None, headers=headers)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": encodable(message), "type": error_type(status),
                      "param": None if param is None else encodable(param), "code": status}}


def encodable(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (lone surrogates) escaped, so an error
    message that quotes client input can always be sent."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def model_not_found(name: object) -> NotFoundError:
    return NotFoundError(f"The model `{encodable(str(name))}` does not exist.", "model")


def from_validation_error(exc: ValidationError | RequestValidationError) -> BadRequestError:
    """Turn pydantic's error list into one 400 naming the first offending field."""
    errors = list(exc.errors())
    if not errors:
        return BadRequestError("Invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # pydantic tags union branches ("str", "list[int]", ...) in the path: cut at the first tag
    cut = next((i for i, p in enumerate(loc) if _is_type_tag(p)), len(loc))
    param = ".".join(loc[:cut]) or None
    where = f" at `{param}`" if param else ""
    branches = []
    for err in errors:
        parts = [str(p) for p in err.get("loc", ()) if p != "body"]
        if cut < len(parts) and parts[:cut] == loc[:cut] and parts[cut] not in branches:
            branches.append(parts[cut])
    if len(branches) > 1:
        return BadRequestError(
            f"Invalid request{where}: expected one of {', '.join(branches)}", param)
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return BadRequestError(f"Invalid request{where}: {msg}{more}", param)


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in _TAGS


_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "constrained-str",
                   "constrained-int", "constrained-float", "function-after", "function-before"})


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, APIError):  # pragma: no cover - registered for APIError only
            raise exc
        return exc.response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, (RequestValidationError, ValidationError)):  # pragma: no cover
            raise exc
        return from_validation_error(exc).response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, StarletteHTTPException):  # pragma: no cover
            raise exc
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def client_gone(_: Request, exc: Exception) -> JSONResponse:
        # the client closed the connection while its body was being read (or h11 already
        # answered a malformed body with a 400): nobody is left to answer, not a server error
        log.debug("client disconnected before its request body was read")
        return JSONResponse(error_body("The client disconnected during the request", 400),
                            status_code=400)

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request", exc_info=exc)
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}", 500),
                            status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, unexpected)
