"""``POST /v1/chat/completions``: messages through the chat template; streaming and not."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine.outputs import Logprob
from server.errors import BadRequestError
from server.http_utils import parse_body
from server.protocol import ChatCompletionRequest
from server.sampling import build_params
from server.serving_common import (
    MIN_LOGPROB, ChoiceState, PreparedPrompt, ServingContext, StreamFormat, make_choices, new_id,
    respond, usage,
)


async def create_chat_completion(ctx: ServingContext, request: Request,
                                 body: dict[str, Any]) -> Response:
    req = parse_body(ChatCompletionRequest, body)
    model = ctx.check_model(req.model)
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
    choices = make_choices(prompts, params.n)
    stream = await ctx.submit(rid, prompts, params, "messages")
    with_logprobs = logprobs is not None
    fmt = None
    if req.stream:
        opts = req.stream_options

        def delta(c: ChoiceState) -> dict[str, Any] | None:
            text = c.text[c.sent_text:]
            new = (c.logprobs or [])[c.sent_tokens:] if with_logprobs else []
            if not text and not new and not c.done:
                return None
            entry: dict[str, Any] = {
                "index": c.index,
                "delta": {"content": text} if text else {},
                "logprobs": {"content": logprob_entries(ctx, new)} if with_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            if c.done:
                entry["stop_reason"] = c.stop_reason
            return entry

        fmt = StreamFormat(
            "chat.completion.chunk", rid, created, model,
            include_usage=bool(opts and opts.include_usage),
            continuous_usage=bool(opts and opts.continuous_usage_stats),
            prelude=lambda c: {"index": c.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None},
            delta=delta)

    def response() -> dict[str, Any]:
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": logprob_entries(ctx, c.logprobs or [])}
                if with_logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"prompt_token_ids": ids, "token_ids": c.token_ids}
                   if req.return_token_ids else {}),
            } for c in choices],
            "usage": usage(prompts, choices),
            "system_fingerprint": None,
        }

    return await respond(ctx, request, stream, choices, prompts, fmt, response)


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

