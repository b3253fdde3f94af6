"""``POST /v1/chat/completions``: messages through the chat template; streaming and not."""

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
from server.protocol import ChatCompletionRequest
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
from server.serving_completions import MIN_LOGPROB


async def create_chat_completion(ctx: ServingContext, request: Request,
                                 body: dict[str, Any]) -> Response:
    req = parse_body(ChatCompletionRequest, body)
    model = ctx.check_model(req.model)
    ctx.check_accepting()
    _check_unsupported(req)
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    try:
        params = build_params(req, max_tokens=max_tokens, logprobs=logprobs,
                              logprobs_param="top_logprobs", defaults=ctx.defaults,
                              limits=ctx.limits)
    except BadRequestError as exc:
        if exc.param == "max_tokens":
            exc.param = max_param
        raise
    text, ids = await ctx.tokens.chat_ids(
        req.messages, add_generation_prompt=req.add_generation_prompt is not False,
        continue_final_message=bool(req.continue_final_message),
        template_kwargs=req.chat_template_kwargs)
    prompts = [PreparedPrompt(text, ids)]
    rid, created = new_id("chatcmpl"), int(time.time())
    n = params.n
    choices = make_choices(prompts, n)
    stream = await ctx.submit(rid, prompts, params, "messages")
    with_logprobs = logprobs is not None
    if req.stream:
        opts = req.stream_options
        events = _stream(ctx, stream, choices, prompts, rid, created, model, with_logprobs,
                         include_usage=bool(opts and opts.include_usage),
                         continuous=bool(opts and opts.continuous_usage_stats))
        return SSEResponse(events, on_close=lambda: ctx.engine.release(stream))
    try:
        await cancel_on_disconnect(request, collect(ctx, stream, choices))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ctx.engine.release(stream)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": logprob_entries(ctx, c.logprobs or [])}
            if with_logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            **({"prompt_token_ids": ids, "token_ids": c.token_ids} if req.return_token_ids
               else {}),
        } for c in choices],
        "usage": usage(prompts, choices),
        "system_fingerprint": None,
    })


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options is only allowed when stream is true",
                              "stream_options")
    if req.tools:
        raise BadRequestError("Tool calling is not supported by this server", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise BadRequestError("Tool calling is not supported by this server", "tool_choice")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise BadRequestError("Only response_format type 'text' is supported",
                              "response_format")
    if req.chat_template is not None:
        raise BadRequestError("Custom chat templates are not supported; the model's template "
                              "is used", "chat_template")


def _token_entry(ctx: ServingContext, token_id: int, logprob: float) -> dict[str, Any]:
    text = ctx.tokens.token_str(token_id)
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB),
            "bytes": list(text.encode("utf-8"))}


def logprob_entries(ctx: ServingContext, entries: list[Logprob]) -> list[dict[str, Any]]:
    out = []
    for lp in entries:
        entry = _token_entry(ctx, lp.token_id, lp.logprob)
        top = sorted(lp.top.items(), key=lambda kv: kv[1], reverse=True)
        entry["top_logprobs"] = [_token_entry(ctx, t, v) for t, v in top]
        out.append(entry)
    return out


async def _stream(ctx: ServingContext, stream: RequestStream, choices: list[ChoiceState],
                  prompts: list[PreparedPrompt], rid: str, created: int, model: str,
                  with_logprobs: bool, *, include_usage: bool,
                  continuous: bool) -> AsyncIterator[str]:
    def chunk(entries: list[dict[str, Any]], final_usage: bool = False) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": entries,
                                "usage": None}
        if final_usage or continuous:
            body["usage"] = usage(prompts, choices)
        return sse(body)

    try:
        for c in choices:
            c.started = True
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for changed in follow(stream, choices, ctx.engine, ctx.config.request_timeout):
            for c in changed:
                delta = c.text[c.sent_text:]
                new = (c.logprobs or [])[c.sent_tokens:] if with_logprobs else []
                if not delta and not new and not c.done:
                    continue
                entry: dict[str, Any] = {
                    "index": c.index,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": {"content": logprob_entries(ctx, new)} if with_logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
                if c.done:
                    entry["stop_reason"] = c.stop_reason
                c.sent_text, c.sent_tokens = len(c.text), len(c.token_ids)
                yield chunk([entry])
        if include_usage:
            yield chunk([], final_usage=True)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - becomes an SSE error event
        yield sse(unexpected_error(exc).body())
    yield SSE_DONE
