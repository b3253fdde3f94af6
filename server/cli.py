"""``specserve serve [MODEL] ...``: flags mirror ``vllm serve``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

from server import __version__
from server.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_BODY_BYTES,
)

log = logging.getLogger("specserve.server")

API_KEY_ENV = "SPECSERVE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# A serving process sees a new matrix-product shape at almost every step (the batch changes);
# oneDNN and ideep each keep up to 1024 compiled kernels by default, which grew RSS by ~500 MiB
# in a 90 s soak. Capped at 64 each, RSS stayed flat after warm-up and the soak served as many
# requests (docs/hardening.md). Read when the first kernel is built, so set before the engine
# starts; an operator's own value wins.
KERNEL_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def cap_kernel_caches(environ: MutableMapping[str, str] = os.environ) -> None:
    for name, value in KERNEL_CACHE_ENV.items():
        environ.setdefault(name, value)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="A small vLLM-like LLM server with speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (like `vllm serve`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    commands.add_parser("bench", help="load-test a server: `specserve bench serve --help` "
                        "(benchmarks/bench_serve.py)")
    return parser


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from engine.args import EngineArgs
    from models.resolve import DEFAULT_MODEL

    d = EngineArgs()
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="built-in model name or a local Hugging Face model folder")
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="bind address")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="names accepted in `model`; the first is used in responses and "
                          "metrics (default: MODEL)")
    net.add_argument("--api-key", action="append", default=None,
                     help=f"require `Authorization: Bearer KEY` on every endpoint except "
                          f"/health and /ping (repeatable; env {API_KEY_ENV})")
    net.add_argument("--metrics-without-auth", action="store_true",
                     help="with --api-key, let /metrics answer without the key (for a "
                          "Prometheus scraper on a trusted network)")
    net.add_argument("--max-logprobs", type=int, default=20)
    net.add_argument("--request-timeout", type=float, default=None,
                     help="seconds after which a request is aborted and answered with an error "
                          "(503 if it never started generating, else 504 / an SSE error event)")
    net.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413")
    net.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                     help="seconds a client may take to send a request's headers (then 408 and "
                          "the connection is closed)")
    net.add_argument("--http-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                     help="seconds a client may take to send a request's body (then 408)")
    net.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE,
                     help="seconds an idle keep-alive connection stays open")
    net.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                     help="in-flight requests (a stream until it ends); past it new requests "
                          "get a JSON 503 with Retry-After (/health, /ping, /metrics exempt)")
    net.add_argument("--shutdown-timeout", type=float, default=0.0,
                     help="seconds in-flight requests may finish after SIGTERM")
    net.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info")
    net.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="no per-request access log lines")
    net.add_argument("--disable-log-stats", action="store_true",
                     help="no periodic throughput / speculative decoding log lines")
    eng = p.add_argument_group("engine")
    eng.add_argument("--dtype", default=d.dtype, help="auto, float32, bfloat16, float16")
    eng.add_argument("--max-model-len", type=int, default=None,
                     help="context length (default: the model's)")
    eng.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    eng.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    eng.add_argument("--max-waiting-requests", type=int, default=None,
                     help="waiting-queue bound; past it requests get 503 + Retry-After (a "
                          "request with more sequences than the bound, prompts x n, gets 400)")
    eng.add_argument("--block-size", type=int, default=d.block_size,
                     help="tokens per KV block (default: 128 on the CPU, 16 on CUDA)")
    eng.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype)
    eng.add_argument("--kv-cache-layout", default=None, help="NHD or HND (default: chosen)")
    eng.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="e.g. 512MiB, 2GiB")
    eng.add_argument("--num-kv-blocks", type=int, default=None)
    eng.add_argument("--attention-backend", default=d.attention_backend)
    eng.add_argument("--speculative-config", default="default",
                     help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\', or '
                          '"none"; default: the built-in model\'s shipped draft when present')
    eng.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    eng.add_argument("--seed", type=int, default=d.seed)
    eng.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                     help="shard the target over N ranks (worker processes; gloo on CPU, "
                          "NCCL on CUDA)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="CUDA: run every step eagerly instead of replaying captured graphs")
    eng.add_argument("--max-cudagraph-capture-size", type=int,
                     default=d.max_cudagraph_capture_size,
                     help="CUDA: the largest decode/verify step, in tokens, run as a graph")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # `specserve bench serve ...`: its own parser
        from benchmarks.bench_serve import main as bench_main

        return bench_main(argv[1:])
    args = make_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2  # pragma: no cover - argparse enforces the subcommand


def _configure_logging(level: str) -> None:
    numeric = logging.INFO if level in ("info", "debug", "trace") else getattr(
        logging, level.upper(), logging.INFO)
    if level in ("debug", "trace"):
        numeric = logging.DEBUG
    logging.basicConfig(level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(numeric)


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_kwargs_from(args: argparse.Namespace, served_name: str) -> dict[str, Any]:
    """``EngineArgs`` keywords from the parsed ``serve`` flags."""
    return {
        "model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_memory": args.kv_cache_memory, "kv_cache_layout": args.kv_cache_layout,
        "num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_waiting_requests": args.max_waiting_requests,
        "speculative_config": args.speculative_config,
        "attention_backend": args.attention_backend, "device": _device(args.device),
        "seed": args.seed, "served_model_name": served_name,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enforce_eager": args.enforce_eager,
        "max_cudagraph_capture_size": args.max_cudagraph_capture_size,
    }


def serve(args: argparse.Namespace) -> int:
    cap_kernel_caches()
    _configure_logging(args.uvicorn_log_level)
    from engine.args import EngineArgs
    from engine.engine import LLMEngine
    from server.app import build_app
    from server.config import ServerConfig
    from server.launch import make_server

    names = tuple(args.served_model_name or [args.model])
    keys = tuple(args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV)
                                  else []))
    engine_kwargs = engine_kwargs_from(args, names[0])
    try:
        server_config = ServerConfig(
            served_model_names=names, api_keys=keys, max_logprobs=args.max_logprobs,
            request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
            log_stats_interval=0.0 if args.disable_log_stats else 10.0,
            metrics_without_auth=args.metrics_without_auth,
            max_body_bytes=args.max_request_body_bytes, header_timeout=args.http_header_timeout,
            body_timeout=args.http_body_timeout, timeout_keep_alive=args.timeout_keep_alive,
            limit_concurrency=args.limit_concurrency)
        engine_config = EngineArgs(**engine_kwargs).create_engine_config()
    except (ValueError, OSError) as exc:  # ConfigError, UnknownModelError, ModelConfigError
        print(f"specserve serve: error: {exc}", file=sys.stderr)
        return 2
    shown = {k: v for k, v in engine_kwargs.items() if v is not None}
    log.info("specserve %s: engine args %s", __version__, json.dumps(shown, default=str))
    log.info("server: host=%s port=%d served_model_names=%s api_key=%s request_timeout=%s "
             "shutdown_timeout=%s", args.host, args.port, list(names),
             "set" if keys else "none", args.request_timeout, args.shutdown_timeout)

    def on_engine_dead(message: str) -> None:
        log.error("the engine died, the server exits with status 1: %s", message)
        server.request_exit(1)

    app = build_app(server_config, engine_config, lambda: LLMEngine(engine_config),
                    on_engine_dead=on_engine_dead)
    server = make_server(app, args.host, args.port, args.uvicorn_log_level,
                         access_log=not args.disable_uvicorn_access_log)
    server.run()
    return server.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
