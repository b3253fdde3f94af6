"""The FastAPI app: routes, lifespan (engine start, drain, stop), auth and error handling.

``build_app`` can be called any number of times in one process: every piece of state (the
engine bridge, the metrics registry, the tokenizer service) hangs off ``app.state.specserve``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server import __version__
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_types import EngineDeadError
from server.errors import (
    BadRequestError,
    ServiceUnavailableError,
    error_body,
    install_error_handlers,
)
from server.http_utils import (
    APIKeyMiddleware,
    ConcurrencyLimitMiddleware,
    parse_body,
    read_json,
)
from server.metrics import ServingMetrics
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.sampling import Limits
from server.serving_chat import create_chat_completion
from server.serving_common import ServingContext
from server.serving_completions import create_completion
from server.tokens import TokenizerService

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

log = logging.getLogger("specserve.server")


class ServerState:
    """Everything one app owns; ``ctx`` exists once the engine is ready."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig,
                 factory: Callable[[], LLMEngine],
                 on_engine_dead: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.engine_config = engine_config
        self._factory = factory
        self._on_engine_dead = on_engine_dead
        self._tokenizer: Any = None
        cache = engine_config.cache
        self.metrics = ServingMetrics(
            config.model_name, lambda: self.engine.snapshot,
            {"block_size": str(cache.block_size), "cache_dtype": str(cache.cache_dtype)},
            speculative=engine_config.speculative is not None,
            log_interval=config.log_stats_interval)
        self.engine = AsyncEngine(self._build_engine, observer=self.metrics,
                                  on_ready=self._ready, on_dead=self._dead)
        self.ctx: ServingContext | None = None
        self.draining = False
        self._drain_task: asyncio.Task[None] | None = None

    def _build_engine(self) -> LLMEngine:  # runs on the engine thread
        from models.hf_folder import load_tokenizer

        engine = self._factory()
        if engine.tokenizer is not None:
            self._tokenizer = load_tokenizer(engine.config.model.path)
        return engine

    def _ready(self, engine: LLMEngine) -> None:  # runs on the event loop
        mc = engine.config.model
        self.ctx = ServingContext(
            config=self.config, engine=self.engine,
            tokens=TokenizerService(self._tokenizer, mc.vocab_size, mc.max_model_len),
            limits=Limits(self.config.max_n, self.config.max_logprobs, mc.vocab_size,
                          mc.max_model_len),
            defaults=dict(engine.generation_defaults), max_model_len=mc.max_model_len,
            model_path=str(mc.path), metrics=self.metrics)
        info = dict(engine.startup_info)
        log.info("engine ready: %s", ", ".join(f"{k}={v}" for k, v in info.items()))
        log.info("serving %s (max_model_len=%d, generation defaults %s)",
                 ", ".join(self.config.served_model_names), mc.max_model_len,
                 engine.generation_defaults or "none")

    def _dead(self, message: str) -> None:
        log.error("engine is dead, /health now returns 503: %s", message)
        if self._on_engine_dead is not None:
            self._on_engine_dead(message)

    def require_ctx(self) -> ServingContext:
        if self.draining:
            raise ServiceUnavailableError("The server is shutting down", retry_after=None)
        if self.engine.state == "dead":
            raise EngineDeadError(f"The engine is dead: {self.engine.error}",
                                  status=self.engine.error_status)
        if self.ctx is None:
            raise ServiceUnavailableError("The server is still loading the model", 5)
        return self.ctx

    async def drain(self, timeout: float) -> None:
        """Refuse new work, wait up to ``timeout`` s for in-flight requests, abort the rest
        (they are answered 503; their streams end with an SSE error event and ``[DONE]``).
        Idempotent."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(timeout))
        await asyncio.shield(self._drain_task)

    async def _drain(self, timeout: float) -> None:
        self.draining = True
        loop = asyncio.get_running_loop()
        if self.engine.num_streams:
            log.info("draining: %d in-flight requests, waiting up to %.1fs",
                     self.engine.num_streams, timeout)
        deadline = loop.time() + timeout
        while self.engine.num_streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_streams:
            log.info("aborting %d in-flight requests", self.engine.abort_all())
            deadline = loop.time() + 5.0
            while self.engine.num_streams and loop.time() < deadline:
                await asyncio.sleep(0.02)


def build_app(config: ServerConfig, engine_config: EngineConfig,
              factory: Callable[[], LLMEngine],
              on_engine_dead: Callable[[str], None] | None = None) -> FastAPI:
    state = ServerState(config, engine_config, factory, on_engine_dead)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await state.drain(config.shutdown_timeout)
            await state.engine.stop()
            if state.ctx is not None:
                state.ctx.tokens.close()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan)
    app.state.specserve = state
    install_error_handlers(app)
    if config.limit_concurrency is not None:  # inside auth: a 401 never takes a slot
        app.add_middleware(ConcurrencyLimitMiddleware, limit=config.limit_concurrency)
    if config.api_keys:
        open_paths = ("/health", "/ping") + (("/metrics",) if config.metrics_without_auth else ())
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys, open_paths=open_paths)

    async def body(request: Request) -> dict[str, Any]:
        return await read_json(request, config.max_body_bytes, config.body_timeout)

    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if state.engine.ready and state.ctx is not None and not state.draining:
            return Response(status_code=200)
        if state.draining:
            reason = "The server is shutting down"
        elif state.engine.state == "dead":
            reason = f"The engine is dead: {state.engine.error}"
        else:
            reason = "The server is still loading the model"
        return JSONResponse(error_body(reason, 503), status_code=503)

    app.add_api_route("/ping", health, methods=["GET", "POST"], include_in_schema=False)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        mc = engine_config.model
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "specserve",
             "root": str(mc.path), "parent": None, "max_model_len": mc.max_model_len,
             "permission": []}
            for name in config.served_model_names]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state.require_ctx(), request, await body(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state.require_ctx(), request,
                                            await body(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, await body(request))
        ctx = state.require_ctx()
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequestError("Send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            text = await ctx.tokens.render_chat(
                req.messages, add_generation_prompt=req.add_generation_prompt is not False,
                continue_final_message=bool(req.continue_final_message),
                template_kwargs=req.chat_template_kwargs)
            ids = await ctx.tokens.encode(text, add_special_tokens=bool(req.add_special_tokens),
                                          param="messages")
        else:
            ids = await ctx.tokens.encode(req.prompt or "",
                                          add_special_tokens=req.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len,
                               "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = ctx.tokens.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await body(request))
        ctx = state.require_ctx()
        ctx.check_model(req.model)
        return {"prompt": await ctx.tokens.decode(req.tokens)}

    return app
