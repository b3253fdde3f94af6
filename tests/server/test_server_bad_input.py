"""Bad input: the right status and error shape, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from srvutil import MODEL, RunningServer, assert_error, start_server

KEY = "sk-test-key"
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 600  # > 512 tokens


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server(api_keys=(KEY,))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(srv: RunningServer) -> Iterator[httpx.Client]:
    with srv.http() as client:
        yield client


def _ok(http: httpx.Client) -> None:
    r = http.post(C, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def ch(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **fields}


CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, json body, status, param)
    ("missing-prompt", C, {"model": MODEL}, 400, "prompt"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty-messages", CHAT, ch(messages=[]), 400, "messages"),
    ("prompt-wrong-type", C, c(prompt=5), 400, "prompt"),
    ("prompt-mixed-list", C, c(prompt=["a", 1]), 400, "prompt"),
    ("max-tokens-string", C, c(max_tokens="many"), 400, "max_tokens"),
    ("messages-string", CHAT, ch(messages="hi"), 400, "messages"),
    ("bad-role", CHAT, ch(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role"),
    ("image-part", CHAT, ch(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content.0"),
    ("temperature-string", C, c(temperature="hot"), 400, "temperature"),
    ("stream-list", C, c(stream=[1]), 400, "stream"),
    ("unknown-model", C, c(model="nope"), 404, "model"),
    ("unknown-model-chat", CHAT, ch(model="nope"), 404, "model"),
    ("prompt-too-long", C, c(prompt=LONG_PROMPT), 400, "prompt"),
    ("chat-too-long", CHAT, ch(messages=[{"role": "user", "content": LONG_PROMPT}]), 400,
     "messages"),
    ("max-tokens-past-context", C, c(max_tokens=512), 400, "prompt"),
    ("max-tokens-over-len", C, c(max_tokens=10**6), 400, "max_tokens"),
    ("max-completion-tokens-over", CHAT, ch(max_completion_tokens=10**6), 400,
     "max_completion_tokens"),
    ("max-tokens-zero", C, c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", C, c(max_tokens=-3), 400, "max_tokens"),
    ("n-zero", C, c(n=0), 400, "n"),
    ("n-negative", C, c(n=-1), 400, "n"),
    ("n-huge", C, c(n=10**20), 400, "n"),
    ("n-over-cap", CHAT, ch(n=17), 400, "n"),
    ("logprobs-over-cap", C, c(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", C, c(logprobs=-1), 400, "logprobs"),
    ("top-logprobs-over-cap", CHAT, ch(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, ch(top_logprobs=2), 400, "top_logprobs"),
    ("top-k-negative", C, c(top_k=-5), 400, "top_k"),
    ("top-k-huge", C, c(top_k=10**12), 400, "top_k"),
    ("temperature-negative", C, c(temperature=-0.1), 400, "temperature"),
    ("top-p-zero", C, c(top_p=0), 400, "top_p"),
    ("top-p-over-one", CHAT, ch(top_p=1.5), 400, "top_p"),
    ("min-p-over-one", C, c(min_p=2), 400, "min_p"),
    ("presence-penalty", C, c(presence_penalty=3), 400, "presence_penalty"),
    ("repetition-penalty-zero", C, c(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition-penalty-huge", C, c(repetition_penalty=1e6), 400, "repetition_penalty"),
    ("seed-huge", C, c(seed=2**70), 400, "seed"),
    ("stream-options-without-stream", C, c(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stream-options-without-stream-chat", CHAT, ch(stream_options={"include_usage": True}),
     400, "stream_options"),
    ("token-out-of-vocab", C, c(prompt=[1, 2, 49152]), 400, "prompt"),
    ("token-negative", C, c(prompt=[-1]), 400, "prompt"),
    ("token-float", C, c(prompt=[1.5, 2]), 400, "prompt"),
    ("stop-token-out-of-vocab", C, c(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("empty-prompt", C, c(prompt=""), 400, "prompt"),
    ("empty-token-list", C, c(prompt=[]), 400, "prompt"),
    ("empty-nested-list", C, c(prompt=[[]]), 400, "prompt"),
    ("empty-stop", C, c(stop=[""]), 400, "stop"),
    ("logit-bias", C, c(logit_bias={"5": 10}), 400, "logit_bias"),
    ("min-tokens-over-max", C, c(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("tools", CHAT, ch(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("too-many-prompts", C, c(prompt=["a"] * 65), 400, "prompt"),
    ("tokenize-both", "/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [49152]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", [c_[1:] for c_ in CASES],
                         ids=[c_[0] for c_ in CASES])
def test_bad_json_fields(http: httpx.Client, path: str, body: Any, status: int,
                         param: str | None) -> None:
    err = assert_error(http.post(path, json=body), status, param)
    if status == 404:
        assert err["message"] == "The model `nope` does not exist." and err["type"] == \
            "NotFoundError"
    if err["type"] == "BadRequestError":
        assert status == 400


@pytest.mark.parametrize("case", ["prompt-too-long", "max-tokens-past-context"])
def test_context_length_message(http: httpx.Client, case: str) -> None:
    body = next(b for i, _, b, _, _ in CASES if i == case)
    assert_error(http.post(C, json=body), 400, contains="maximum context length is 512 tokens")


RAW: list[tuple[str, bytes, int]] = [
    ("malformed-json", b'{"model": "x", "prompt": ', 400),
    ("not-an-object", b"[1, 2, 3]", 400),
    ("empty-body", b"", 400),
    ("invalid-utf8", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400),
    ("nan", b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}', 400),
    ("infinity", b'{"prompt": "a", "max_tokens": 2, "top_p": 1e999}', 400),
    ("huge-int", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", 400),
    ("deep-nesting", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
]


@pytest.mark.parametrize("body,status", [r[1:] for r in RAW], ids=[r[0] for r in RAW])
def test_bad_raw_bodies(http: httpx.Client, body: bytes, status: int) -> None:
    for path in (C, CHAT):
        assert_error(http.post(path, content=body,
                               headers={"Content-Type": "application/json"}), status)


def test_oversized_body(http: httpx.Client) -> None:
    body = json.dumps({"model": MODEL, "prompt": "a" * (5 << 20)}).encode()
    assert_error(http.post(C, content=body, headers={"Content-Type": "application/json"}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for _ in range(6):
            yield b" " * (1 << 20)

    assert_error(http.post(C, content=chunks(), headers={"Content-Type": "application/json"}),
                 413)


def test_auth(srv: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        err = assert_error(httpx.post(srv.url(C), json=body, headers=headers), 401)
        assert err["type"] == "AuthenticationError"
    assert_error(httpx.get(srv.url("/v1/models")), 401)
    # every endpoint but the health checks is guarded (see test_server_hardening.py)
    assert httpx.get(srv.url("/health")).status_code == 200
    assert_error(httpx.get(srv.url("/metrics")), 401)
    assert_error(httpx.post(srv.url("/tokenize"), json={"prompt": "a"}), 401)
    ok = httpx.post(srv.url(C), json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(C), 405)


def test_openai_client_sees_typed_errors(srv: RunningServer) -> None:
    import openai

    client = srv.openai()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    assert "maximum context length is 512 tokens" in str(info.value)
    bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_server_still_serves_after_bad_input(http: httpx.Client) -> None:
    for _, path, body, _, _ in CASES[:10]:
        http.post(path, json=body)
    _ok(http)
    stream = http.post(C, json=c(stream=True, max_tokens=3))
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
