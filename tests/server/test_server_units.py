"""Fast unit tests of the server's pure pieces (no model, no HTTP)."""

from __future__ import annotations

import asyncio

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from server.config import ServerConfig, ServerConfigError
from server.engine_types import AbortedEvent, OutputEvent, RequestStream
from server.errors import BadRequestError, error_body, error_type
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling import Limits, build_params

LIMITS = Limits(max_n=16, max_logprobs=20, vocab_size=100, max_model_len=64)


def params(req: CompletionRequest, defaults: dict | None = None, max_tokens: int | None = 4):
    return build_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                        logprobs_param="logprobs", defaults=defaults or {}, limits=LIMITS)


def test_default_precedence_request_then_model_then_openai() -> None:
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    p = params(CompletionRequest(prompt="x"), gen)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
    p = params(CompletionRequest(prompt="x", temperature=0, top_p=1, top_k=-1), gen)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)
    p = params(CompletionRequest(prompt="x"))
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def test_tiny_temperature_is_greedy_and_n_splits_seeds() -> None:
    assert params(CompletionRequest(prompt="x", temperature=1e-30)).temperature == 0.0
    p = params(CompletionRequest(prompt="x", n=3, seed=5))
    assert [s.seed for s in p.split()] == [5, 6, 7] and all(s.n == 1 for s in p.split())


@pytest.mark.parametrize("fields,param", [
    ({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"), ({"top_k": 101}, "top_k"),
    ({"stop_token_ids": [100]}, "stop_token_ids"), ({"seed": 2**64}, "seed"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"repetition_penalty": 1e-9}, "repetition_penalty"), ({"logit_bias": {"1": 1}}, "logit_bias"),
])
def test_build_params_rejects(fields: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        params(CompletionRequest(prompt="x", **fields))
    assert info.value.param == param and info.value.status == 400


def test_max_tokens_bounds() -> None:
    with pytest.raises(BadRequestError, match="maximum context length is 64 tokens"):
        params(CompletionRequest(prompt="x"), max_tokens=65)
    assert params(CompletionRequest(prompt="x"), max_tokens=None).max_tokens is None


def test_schema_rejects_non_finite_and_accepts_unknown_fields() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", temperature=float("inf"))
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "whatever": 1})
    assert req.messages[0].content == "hi"


def test_error_shape_and_types() -> None:
    assert error_body("m", 404, "model") == {"error": {
        "message": "m", "type": "NotFoundError", "param": "model", "code": 404}}
    assert error_type(503) == "ServiceUnavailableError"
    assert error_type(418).endswith("Error")


def test_server_config_validation() -> None:
    with pytest.raises(ServerConfigError):
        ServerConfig(())
    with pytest.raises(ServerConfigError):
        ServerConfig(("m",), request_timeout=0)
    assert ServerConfig(("a", "b")).model_name == "a"


def _out(rid: str, text: str, finished: bool) -> RequestOutput:
    comp = CompletionOutput(0, text, [1] * len(text), finish_reason="length" if finished else None)
    return RequestOutput(rid, None, [1], [comp], finished, num_new_tokens=1)


def test_request_stream_merges_cumulative_outputs() -> None:
    async def run() -> None:
        stream = RequestStream(["a-0", "a-1"])
        stream.put(OutputEvent(0, _out("a-0", "x", False)))
        stream.put(OutputEvent(1, _out("a-1", "y", False)))
        stream.put(OutputEvent(0, _out("a-0", "xy", True)))
        events = await stream.next_events()
        assert [(e.index, e.output.outputs[0].text) for e in events] == [(0, "xy"), (1, "y")]
        assert not stream.finished
        stream.put(AbortedEvent(1))
        assert stream.finished

    asyncio.run(run())


class _FakeEngine:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self, stream: RequestStream, notify: bool = False) -> None:
        self.aborted += 1


def _ctx(timeout: float):
    from server.metrics import ServingMetrics
    from server.serving_common import ServingContext
    from server.tokens import TokenizerService

    from server.engine_types import EngineSnapshot

    metrics = ServingMetrics("m", EngineSnapshot, {}, log_interval=0)
    return ServingContext(config=ServerConfig(("m",), request_timeout=timeout),
                          engine=_FakeEngine(), tokens=TokenizerService(None, 100),  # type: ignore[arg-type]
                          limits=LIMITS, defaults={}, max_model_len=64, model_path="m",
                          metrics=metrics)


def _timeouts(ctx, stage: str) -> float:
    return ctx.metrics.registry.get_sample_value(
        "specserve:request_timeouts_total", {"model_name": "m", "engine": "0", "stage": stage})


@pytest.mark.parametrize("produced,status", [(False, 503), (True, 504)])
def test_timeout_is_an_error(produced: bool, status: int) -> None:
    """Past --request-timeout: 503 (+ Retry-After) if no token came yet, else 504; the
    request is aborted and the timeout counted by stage; never finish_reason "abort"."""
    from server.errors import APIError
    from server.serving_common import PreparedPrompt, follow, make_choices

    async def run() -> APIError:
        ctx = _ctx(0.05)
        stream = RequestStream(["r-0"])
        if produced:
            stream.put(OutputEvent(0, _out("r-0", "ab", False)))
        choices = make_choices([PreparedPrompt("p", [1])], 1)
        with pytest.raises(APIError) as info:
            async for changed in follow(ctx, stream, choices):
                assert all(c.finish_reason is None for c in changed)
        assert ctx.engine.aborted == 1
        stage = "generating" if produced else "waiting"
        assert _timeouts(ctx, stage) == 1
        return info.value

    err = asyncio.run(run())
    assert err.status == status
    assert ("Retry-After" in err.headers) == (status == 503)
    assert "timed out" in err.message


def test_aborted_request_is_an_error() -> None:
    from server.errors import ServiceUnavailableError
    from server.serving_common import PreparedPrompt, follow, make_choices

    async def run() -> None:
        ctx = _ctx(10)
        stream = RequestStream(["r-0"])
        stream.put(OutputEvent(0, _out("r-0", "ab", False)))
        stream.put(AbortedEvent(0))
        choices = make_choices([PreparedPrompt("p", [1])], 1)
        with pytest.raises(ServiceUnavailableError, match="shutting down"):
            async for _ in follow(ctx, stream, choices):
                pass

    asyncio.run(run())


def test_parse_body_is_strict() -> None:
    from server.http_utils import parse_body

    for field, value in (("stream", "yes"), ("max_tokens", "10"), ("seed", "42"),
                         ("n", 2.0), ("ignore_eos", 0), ("stop", 5)):
        with pytest.raises(BadRequestError) as info:
            parse_body(CompletionRequest, {"prompt": "x", field: value})
        assert info.value.param == field
    req = parse_body(CompletionRequest, {"prompt": "x", "temperature": 1, "top_p": 0.5})
    assert req.temperature == 1.0
