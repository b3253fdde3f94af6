"""What both generation endpoints share: admission, submission, following outputs, usage."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.engine import QueueFullError, RequestValidationError
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_types import (
    AbortedEvent,
    EngineDeadError,
    FailedEvent,
    OutputEvent,
    RequestStream,
    SubRequest,
)
from server.errors import (
    APIError,
    BadRequestError,
    InternalServerError,
    ServiceUnavailableError,
    model_not_found,
)
from server.sampling import Limits, split_n
from server.tokens import TokenizerService

log = logging.getLogger("specserve.server")


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
    started: bool = False  # streaming: the first chunk (role / echo) went out

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
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.config.served_model_names:
            raise model_not_found(name)
        return self.config.model_name

    def check_accepting(self) -> None:
        if self.draining:
            raise ServiceUnavailableError("The server is shutting down; retry on another "
                                          "replica", retry_after=None)
        if self.engine.state == "dead":
            raise EngineDeadError(f"The engine is dead: {self.engine.error}")
        if not self.engine.ready:
            raise ServiceUnavailableError("The server is still loading the model", 5)

    async def submit(self, request_id: str, prompts: Sequence[PreparedPrompt],
                     params: SamplingParams, prompt_param: str) -> RequestStream:
        """Queue ``len(prompts) * n`` engine requests; choice ``p * n + i``."""
        subs: list[SubRequest] = []
        per_prompt = split_n(params)
        for p, prompt in enumerate(prompts):
            for i, sub_params in enumerate(per_prompt):
                index = p * len(per_prompt) + i
                subs.append(SubRequest(f"{request_id}-{index}", prompt.token_ids, sub_params,
                                       prompt.text))
        try:
            return await self.engine.add(subs)
        except RequestValidationError as exc:
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


async def follow(
    stream: RequestStream,
    choices: list[ChoiceState],
    engine: AsyncEngine,
    timeout: float | None,
) -> AsyncIterator[list[ChoiceState]]:
    """Yield the choices that changed, batch by batch, until every choice is done.

    Raises the ``APIError`` of a failed request. Past ``timeout`` seconds the request is
    aborted and the unfinished choices end with ``finish_reason="abort"``.
    """
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    while not all(c.done for c in choices):
        remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
        try:
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            events = await asyncio.wait_for(stream.next_events(), remaining)
        except asyncio.TimeoutError:
            engine.abort(stream)
            changed = [c for c in choices if not c.done]
            for c in changed:
                c.finish_reason = "abort"
            yield changed
            return
        changed: dict[int, ChoiceState] = {}  # each choice once per batch, in order
        for ev in events:
            if isinstance(ev, FailedEvent):
                raise ev.error
            choice = choices[ev.index]
            if choice.done:
                continue
            if isinstance(ev, AbortedEvent):
                choice.finish_reason = "abort"
            elif isinstance(ev, OutputEvent):
                out = ev.output.outputs[0]
                choice.text = out.text
                choice.token_ids = out.token_ids
                choice.logprobs = out.logprobs
                if ev.output.finished:
                    choice.finish_reason = out.finish_reason or "abort"
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


async def collect(ctx: ServingContext, stream: RequestStream, choices: list[ChoiceState]) -> None:
    """Follow a non-streaming request until every choice is done."""
    async for _ in follow(stream, choices, ctx.engine, ctx.config.request_timeout):
        pass
