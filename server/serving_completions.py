"""``POST /v1/completions``: text (or token ids) in, text out; streaming and not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import Logprob
from server.engine_types import RequestStream
from server.errors import BadRequestError
from server.http_utils import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    cancel_on_disconnect,
    parse_body,
    sse,
)
from server.protocol import CompletionRequest, Prompt
from server.sampling import build_params
from server.serving_common import (
    ChoiceState,
    collect,
    PreparedPrompt,
    ServingContext,
    follow,
    make_choices,
    new_id,
    unexpected_error,
    usage,
)

MIN_LOGPROB = -9999.0  # JSON has no -Infinity
MAX_CHOICES = 256  # engine requests one HTTP request may create


async def create_completion(ctx: ServingContext, request: Request,
                            body: dict[str, Any]) -> Response:
    req = parse_body(CompletionRequest, body)
    model = ctx.check_model(req.model)
    ctx.check_accepting()
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options is only allowed when stream is true",
                              "stream_options")
    if req.suffix:
        raise BadRequestError("suffix (insert mode) is not supported", "suffix")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise BadRequestError("best_of is not supported unless it equals n", "best_of")
    echo = bool(req.echo)
    if echo and req.logprobs is not None:
        raise BadRequestError("echo with logprobs needs prompt logprobs, which this server "
                              "does not compute yet", "echo")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    params = build_params(req, max_tokens=1 if echo and max_tokens == 0 else max_tokens,
                          logprobs=req.logprobs, logprobs_param="logprobs",
                          defaults=ctx.defaults, limits=ctx.limits)
    prompts = await prepare_prompts(ctx, req.prompt, n, need_text=echo)
    rid, created = new_id("cmpl"), int(time.time())
    choices = make_choices(prompts, n)
    if echo and max_tokens == 0:
        if req.stream:
            raise BadRequestError("max_tokens=0 with echo is only supported without streaming",
                                  "max_tokens")
        for c in choices:
            c.finish_reason = "length"
        return JSONResponse(_response(ctx, rid, created, model, choices, prompts, echo, False,
                                      bool(req.return_token_ids)))
    stream = await ctx.submit(rid, prompts, params, "prompt")
    if req.stream:
        opts = req.stream_options
        events = _stream(ctx, stream, choices, prompts, rid, created, model, echo,
                         logprobs=req.logprobs is not None,
                         token_ids=bool(req.return_token_ids),
                         include_usage=bool(opts and opts.include_usage),
                         continuous=bool(opts and opts.continuous_usage_stats))
        return SSEResponse(events, on_close=lambda: ctx.engine.release(stream))
    try:
        await cancel_on_disconnect(request, collect(ctx, stream, choices))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ctx.engine.release(stream)
    return JSONResponse(_response(ctx, rid, created, model, choices, prompts, echo,
                                  req.logprobs is not None, bool(req.return_token_ids)))


async def prepare_prompts(ctx: ServingContext, prompt: Prompt, n: int = 1,
                          need_text: bool = False) -> list[PreparedPrompt]:
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise BadRequestError("prompt must not be empty", "prompt")
    if len(items) > ctx.config.max_prompts:
        raise BadRequestError(f"At most {ctx.config.max_prompts} prompts per request, got "
                              f"{len(items)}", "prompt")
    if len(items) * n > MAX_CHOICES:
        raise BadRequestError(f"A request may ask for at most {MAX_CHOICES} choices (prompts "
                              f"x n), got {len(items) * n}", "n")
    out = []
    for item in items:
        if not item:
            raise BadRequestError("prompt must not be empty", "prompt")
        if isinstance(item, str):
            out.append(PreparedPrompt(item, await ctx.tokens.encode(item)))
            continue
        ctx.tokens.check_ids(item, "prompt")
        text = await ctx.tokens.decode(item) if need_text else None
        out.append(PreparedPrompt(text, item))
    return out


def logprobs_block(ctx: ServingContext, entries: list[Logprob], offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in entries:
        text = ctx.tokens.token_str(lp.token_id)
        top = {ctx.tokens.token_str(t): max(v, MIN_LOGPROB) for t, v in lp.top.items()}
        top.setdefault(text, max(lp.logprob, MIN_LOGPROB))
        tokens.append(text)
        token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _response(ctx: ServingContext, rid: str, created: int, model: str,
              choices: list[ChoiceState], prompts: list[PreparedPrompt], echo: bool,
              with_logprobs: bool, token_ids: bool) -> dict[str, Any]:
    out = []
    for c in choices:
        prefix = (c.prompt.text or "") if echo else ""
        lps = None
        if with_logprobs:
            lps = logprobs_block(ctx, c.logprobs or [], len(prefix))
        choice = {"index": c.index, "text": prefix + c.text, "logprobs": lps,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if token_ids:
            choice.update(prompt_token_ids=c.prompt.token_ids, token_ids=c.token_ids)
        out.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": usage(prompts, choices), "system_fingerprint": None}


async def _stream(ctx: ServingContext, stream: RequestStream, choices: list[ChoiceState],
                  prompts: list[PreparedPrompt], rid: str, created: int, model: str,
                  echo: bool, *, logprobs: bool, token_ids: bool, include_usage: bool,
                  continuous: bool) -> AsyncIterator[str]:
    def chunk(entries: list[dict[str, Any]], final_usage: bool = False) -> str:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": model, "choices": entries, "usage": None}
        if final_usage or continuous:
            body["usage"] = usage(prompts, choices)
        return sse(body)

    try:
        if echo:
            for c in choices:
                yield chunk([{"index": c.index, "text": c.prompt.text or "", "logprobs": None,
                              "finish_reason": None, "stop_reason": None}])
        async for changed in follow(stream, choices, ctx.engine, ctx.config.request_timeout):
            for c in changed:
                delta = c.text[c.sent_text:]
                new = (c.logprobs or [])[c.sent_tokens:] if logprobs else []
                new_ids = token_ids and len(c.token_ids) > c.sent_tokens
                if not delta and not new and not new_ids and not c.done:
                    continue
                offset = (len(c.prompt.text or "") if echo else 0) + c.sent_text
                block = logprobs_block(ctx, new, offset) if logprobs else None
                entry = {"index": c.index, "text": delta, "logprobs": block,
                         "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason if c.done else None}
                if token_ids:
                    entry["token_ids"] = c.token_ids[c.sent_tokens:]
                c.sent_text, c.sent_tokens = len(c.text), len(c.token_ids)
                yield chunk([entry])
        if include_usage:
            yield chunk([], final_usage=True)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - becomes an SSE error event
        yield sse(unexpected_error(exc).body())
    yield SSE_DONE
