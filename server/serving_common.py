"""What both generation endpoints share: submission, following outputs, the SSE skeleton
(chunks, usage, cancellation, error event, ``[DONE]``), the non-streaming request/release path
and usage.

A request never ends looking like a success when it did not finish: past
``--request-timeout`` it is aborted and answered with an error (503 if it never produced a
token, 504 otherwise; an SSE ``error`` event before ``[DONE]`` once a stream has started), and
a request aborted by a shutdown gets a 503 error the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.engine import QueueFullError, RequestValidationError
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_types import (
    AbortedEvent,
    FailedEvent,
    OutputEvent,
    RequestStream,
    SubRequest,
)
from server.errors import (
    APIError,
    BadRequestError,
    GatewayTimeoutError,
    InternalServerError,
    ServiceUnavailableError,
    model_not_found,
)
from server.http_utils import SSE_DONE, ClientDisconnected, SSEResponse, cancel_on_disconnect, sse
from server.metrics import ServingMetrics
from server.sampling import Limits
from server.tokens import TokenizerService

log = logging.getLogger("specserve.server")
MIN_LOGPROB = -9999.0  # JSON has no -Infinity: the floor of every logprob we send


@dataclass(frozen=True)
class PreparedPrompt:
    text: str | None
    token_ids: list[int]


@dataclass
class ChoiceState:
    """Cumulative state of one choice, plus how much of it was already streamed."""

    index: int
    prompt: PreparedPrompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ServingContext:
    """Per-app state the endpoints need; built once the engine is ready."""

    config: ServerConfig
    engine: AsyncEngine
    tokens: TokenizerService
    limits: Limits
    defaults: dict[str, Any]
    max_model_len: int
    model_path: str
    metrics: ServingMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.config.served_model_names:
            raise model_not_found(name)
        return self.config.model_name

    async def submit(self, request_id: str, prompts: Sequence[PreparedPrompt],
                     params: SamplingParams, prompt_param: str) -> RequestStream:
        """Queue ``len(prompts) * n`` engine requests; choice ``p * n + i``."""
        per_prompt = params.split()
        subs = [SubRequest(f"{request_id}-{p * len(per_prompt) + i}", prompt.token_ids,
                           sub_params, prompt.text)
                for p, prompt in enumerate(prompts) for i, sub_params in enumerate(per_prompt)]
        try:
            return await self.engine.add(subs)
        except RequestValidationError as exc:
            if exc.code == "queue_capacity":
                param = "n" if params.n > 1 else prompt_param
            else:
                param = prompt_param if exc.param == "prompt" else exc.param
            raise BadRequestError(str(exc), param) from exc
        except QueueFullError as exc:
            raise ServiceUnavailableError(str(exc), retry_after=1) from exc
        except APIError:
            raise
        except Exception as exc:
            log.exception("adding request %s failed", request_id)
            raise InternalServerError(f"Adding the request failed: {type(exc).__name__}") from exc


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def make_choices(prompts: Sequence[PreparedPrompt], n: int) -> list[ChoiceState]:
    return [ChoiceState(p * n + i, prompt) for p, prompt in enumerate(prompts) for i in range(n)]


def _timed_out(ctx: ServingContext, choices: Sequence[ChoiceState]) -> APIError:
    timeout = ctx.config.request_timeout
    generated = sum(len(c.token_ids) for c in choices)
    started = generated > 0
    if ctx.metrics is not None:
        ctx.metrics.on_timeout("generating" if started else "waiting")
    if not started:
        return ServiceUnavailableError(
            f"The request timed out after {timeout:g} s (--request-timeout) before it produced "
            "a token: the server is overloaded; retry later", retry_after=1)
    return GatewayTimeoutError(
        f"The request timed out after {timeout:g} s (--request-timeout) with {generated} "
        "tokens generated; it was aborted before it finished")


async def follow(
    ctx: ServingContext,
    stream: RequestStream,
    choices: list[ChoiceState],
) -> AsyncIterator[list[ChoiceState]]:
    """Yield the choices that changed, batch by batch, until every choice is done.

    Raises the ``APIError`` of a failed request, a timeout error past ``--request-timeout``
    (the request is aborted first) and a 503 when the server aborted the request (shutdown).
    """
    loop = asyncio.get_running_loop()
    timeout = ctx.config.request_timeout
    deadline = None if timeout is None else loop.time() + timeout
    while not all(c.done for c in choices):
        remaining = None if deadline is None else deadline - loop.time()
        try:
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            events = await asyncio.wait_for(stream.next_events(), remaining)
        except asyncio.TimeoutError:
            ctx.engine.abort(stream)
            raise _timed_out(ctx, choices) from None
        changed: dict[int, ChoiceState] = {}  # each choice once per batch, in order
        for ev in events:
            if isinstance(ev, FailedEvent):
                raise ev.error
            choice = choices[ev.index]
            if choice.done:
                continue
            if isinstance(ev, AbortedEvent):
                ctx.engine.abort(stream)
                raise ServiceUnavailableError(
                    "The server is shutting down; the request was aborted before it finished",
                    retry_after=None)
            if isinstance(ev, OutputEvent):
                out = ev.output.outputs[0]
                choice.text = out.text
                choice.token_ids = out.token_ids
                choice.logprobs = out.logprobs
                if ev.output.finished:
                    if out.finish_reason not in ("stop", "length"):
                        ctx.engine.abort(stream)
                        raise InternalServerError(
                            f"The request ended without finishing ({out.finish_reason})")
                    choice.finish_reason = out.finish_reason
                    choice.stop_reason = out.stop_reason
            changed[choice.index] = choice
        if changed:
            yield list(changed.values())


def usage(prompts: Sequence[PreparedPrompt], choices: Sequence[ChoiceState]) -> dict[str, int]:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def unexpected_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log.exception("error while generating", exc_info=exc)
    return InternalServerError(f"Internal server error: {type(exc).__name__}")


@dataclass
class StreamFormat:
    """What differs between the endpoints' SSE streams."""

    object: str  # "chat.completion.chunk" or "text_completion"
    rid: str
    created: int
    model: str
    include_usage: bool
    continuous_usage: bool
    # the chunk entries sent before any output (chat: the role; completions: the echo)
    prelude: Callable[[ChoiceState], dict[str, Any] | None]
    # the entry for a changed choice (its unsent part), or None when there is nothing to send
    delta: Callable[[ChoiceState], dict[str, Any] | None]


async def stream_events(ctx: ServingContext, stream: RequestStream, choices: list[ChoiceState],
                        prompts: list[PreparedPrompt], fmt: StreamFormat) -> AsyncIterator[str]:
    """The SSE body of a streaming request; any failure ends it with an ``error`` event
    before ``[DONE]``."""

    def chunk(entries: list[dict[str, Any]], final_usage: bool = False) -> str:
        body: dict[str, Any] = {"id": fmt.rid, "object": fmt.object, "created": fmt.created,
                                "model": fmt.model, "choices": entries, "usage": None}
        if final_usage or fmt.continuous_usage:
            body["usage"] = usage(prompts, choices)
        return sse(body)

    try:
        for c in choices:
            entry = fmt.prelude(c)
            if entry is not None:
                yield chunk([entry])
        async for changed in follow(ctx, stream, choices):
            for c in changed:
                entry = fmt.delta(c)
                if entry is None:
                    continue
                c.sent_text, c.sent_tokens = len(c.text), len(c.token_ids)
                yield chunk([entry])
        if fmt.include_usage:
            yield chunk([], final_usage=True)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - becomes an SSE error event
        yield sse(unexpected_error(exc).body())
    yield SSE_DONE


async def respond(ctx: ServingContext, request: Request, stream: RequestStream,
                  choices: list[ChoiceState], prompts: list[PreparedPrompt],
                  fmt: StreamFormat | None,
                  body: Callable[[], dict[str, Any]]) -> Response:
    """Stream (``fmt`` given) or wait for every choice and answer ``body()``; the engine
    requests are released in every case (a disconnected client gets 499)."""
    if fmt is not None:
        return SSEResponse(stream_events(ctx, stream, choices, prompts, fmt),
                           on_close=lambda: ctx.engine.release(stream))

    async def collect() -> None:
        async for _ in follow(ctx, stream, choices):
            pass

    try:
        await cancel_on_disconnect(request, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ctx.engine.release(stream)
    return JSONResponse(body())
