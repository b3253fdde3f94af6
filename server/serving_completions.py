"""``POST /v1/completions``: text (or token ids) in, text out; streaming and not."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import Logprob
from server.errors import BadRequestError
from server.http_utils import parse_body
from server.protocol import CompletionRequest, Prompt
from server.sampling import build_params
from server.serving_common import (
    MIN_LOGPROB,
    ChoiceState,
    PreparedPrompt,
    ServingContext,
    StreamFormat,
    make_choices,
    new_id,
    respond,
    usage,
)

MAX_CHOICES = 256  # engine requests one HTTP request may create


async def create_completion(ctx: ServingContext, request: Request,
                            body: dict[str, Any]) -> Response:
    req = parse_body(CompletionRequest, body)
    model = ctx.check_model(req.model)
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
    with_logprobs, token_ids = req.logprobs is not None, bool(req.return_token_ids)
    if echo and max_tokens == 0:
        if req.stream:
            raise BadRequestError("max_tokens=0 with echo is only supported without streaming",
                                  "max_tokens")
        for c in choices:
            c.finish_reason = "length"
        return JSONResponse(_response(ctx, rid, created, model, choices, prompts, echo, False,
                                      token_ids))
    stream = await ctx.submit(rid, prompts, params, "prompt")
    fmt = None
    if req.stream:
        opts = req.stream_options

        def prelude(c: ChoiceState) -> dict[str, Any] | None:
            if not echo:
                return None
            return {"index": c.index, "text": c.prompt.text or "", "logprobs": None,
                    "finish_reason": None, "stop_reason": None}

        def delta(c: ChoiceState) -> dict[str, Any] | None:
            text = c.text[c.sent_text:]
            new = (c.logprobs or [])[c.sent_tokens:] if with_logprobs else []
            new_ids = token_ids and len(c.token_ids) > c.sent_tokens
            if not text and not new and not new_ids and not c.done:
                return None
            offset = (len(c.prompt.text or "") if echo else 0) + c.sent_text
            entry: dict[str, Any] = {
                "index": c.index, "text": text,
                "logprobs": logprobs_block(ctx, new, offset) if with_logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason if c.done else None}
            if token_ids:
                entry["token_ids"] = c.token_ids[c.sent_tokens:]
            return entry

        fmt = StreamFormat("text_completion", rid, created, model,
                           include_usage=bool(opts and opts.include_usage),
                           continuous_usage=bool(opts and opts.continuous_usage_stats),
                           prelude=prelude, delta=delta)
    return await respond(
        ctx, request, stream, choices, prompts, fmt,
        lambda: _response(ctx, rid, created, model, choices, prompts, echo, with_logprobs,
                          token_ids))


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
    for item in items:  # every check before any tokenization
        if not item:
            raise BadRequestError("prompt must not be empty", "prompt")
        if isinstance(item, str):
            ctx.tokens.check_text_length(item, "prompt")
    out = []
    for item in items:
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

