"""HTTP plumbing: bounded JSON bodies, SSE responses that notice disconnects, API-key auth."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import (
    BadRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    UnsupportedMediaTypeError,
    error_body,
    from_validation_error,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_json_content_type(request: Request) -> None:
    """POST bodies must be declared JSON. A ``text/plain`` (or missing) type is what a web
    page can send cross-origin without a CORS preflight, so accepting it would let any page
    drive a local server."""
    ctype = request.headers.get("content-type")
    media = (ctype or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                           and media.endswith("+json")):
        raise UnsupportedMediaTypeError(
            f"Content-Type must be application/json, got {ctype or 'none'}")


async def read_json(request: Request, limit: int, timeout: float | None = None) -> dict[str, Any]:
    """Check the content type, read at most ``limit`` bytes within ``timeout`` seconds and
    parse a JSON object, with 400/408/413/415 errors. Strings that UTF-8 cannot carry (lone
    surrogates from ``\\ud800`` escapes) are refused here, before anything else sees them."""
    check_json_content_type(request)
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise BadRequestError("Invalid Content-Length header")
        if int(length) > limit:
            raise PayloadTooLargeError(
                f"The request body is {int(length)} bytes; the limit is {limit} bytes")
    try:
        raw = await asyncio.wait_for(_read_body(request, limit), timeout)
    except asyncio.TimeoutError:
        raise RequestTimeoutError(  # the rest of the body is never read: close after this
            f"The request body was not received within {timeout:g} seconds",
            headers={"Connection": "close"}) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"The request body is not valid UTF-8: {exc}") from exc
    if not text.strip():
        raise BadRequestError("The request body is empty; send a JSON object")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequestError(
            f"Malformed JSON body: {exc.msg} (line {exc.lineno}, column {exc.colno})") from exc
    except (ValueError, RecursionError) as exc:
        raise BadRequestError(f"Malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object")
    where = _unencodable(body, [])
    if where is not None:
        param = ".".join(where) or None
        raise BadRequestError(
            f"Invalid string{f' at `{param}`' if param else ''}: lone UTF-16 surrogates "
            "(\\ud800-\\udfff) are not valid Unicode text", param)
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"The request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _unencodable(value: Any, path: list[str]) -> list[str] | None:
    """The path of the first string (value or key) holding a surrogate, else None."""
    stack: list[tuple[Any, list[str]]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not _is_text(key):
                    return [*where, key.encode("utf-8", "backslashreplace").decode()]
                stack.append((sub, [*where, key]))
        elif isinstance(item, list):
            stack.extend((sub, [*where, str(i)]) for i, sub in enumerate(item))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_body(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    except RecursionError as exc:
        raise BadRequestError("The request body is nested too deeply") from exc


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(
        payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """Streams ``events`` as ``text/event-stream``; a client disconnect cancels the stream
    at once, closes the generator (its ``finally`` runs) and then calls ``on_close``."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self._events = events
        self._on_close = on_close
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _pump(self, send: Send) -> None:
        async for data in self._events:
            await send({"type": "http.response.body", "body": data.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, watch):
                    task.cancel()
                await asyncio.gather(pump, watch, return_exceptions=True)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                exc = pump.exception()
                if not isinstance(exc, OSError):
                    raise exc  # type: ignore[misc]
        finally:
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            self._on_close()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` until it finishes or the client disconnects (then it is cancelled and
    ``ClientDisconnected`` raised). The request body must already have been read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class APIKeyMiddleware:
    """Bearer-token auth on every path except ``open_paths`` (health checks), compared in
    constant time over SHA-256 digests; 401 in the nested error shape. CORS preflights
    (OPTIONS) pass: they carry no credentials and run no handler."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str],
                 open_paths: Sequence[str] = ("/health", "/ping")):
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self._open = frozenset(open_paths)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        ok = False
        for expected in self._digests:
            ok |= hmac.compare_digest(digest, expected)
        return ok and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS" or not self._digests
                or scope.get("path", "") in self._open):
            await self.app(scope, receive, send)
            return
        if self._authorized(Headers(scope=scope).get("authorization", "")):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body("Unauthorized: a valid API key is required (Authorization: Bearer KEY)",
                       401),
            status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class ConcurrencyLimitMiddleware:
    """At most ``limit`` HTTP requests in flight; past it a 503 in the OpenAI error shape
    with ``Retry-After`` (``--limit-concurrency``).

    A request is in flight from its first byte reaching the app until the app has sent the
    whole response, so a stream counts until its last event (or its client's disconnect).
    Idle keep-alive connections and connections still sending headers do not count (those are
    bounded by ``--timeout-keep-alive`` and ``--http-header-timeout``), unlike uvicorn's own
    ``limit_concurrency``, which counts connections and answers in plain text.

    ``/health``, ``/ping`` and ``/metrics`` are exempt: they are cheap, and an overloaded
    server must still tell its load balancer it is alive (a 503 there would pull a busy but
    healthy replica out of rotation, vLLM's health check behaves the same) and show Prometheus
    why it is busy.
    """

    def __init__(self, app: ASGIApp, limit: int,
                 exempt_paths: Sequence[str] = ("/health", "/ping", "/metrics"),
                 retry_after: int = 1) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0
        self._exempt = frozenset(exempt_paths)
        self._retry_after = retry_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in self._exempt:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            message = (f"The server is at its limit of {self.limit} concurrent requests "
                       "(--limit-concurrency); retry later")
            response = JSONResponse(error_body(message, 503), status_code=503,
                                    headers={"Retry-After": str(self._retry_after)})
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
