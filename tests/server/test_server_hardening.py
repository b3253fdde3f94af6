"""Defects found by attacking the server (issue 17): auth on every endpoint, size bounds
before tokenizing, content types, strict types, slow clients, per-step token counters."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from srvutil import MODEL, RunningServer, assert_error, start_server

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT = BODY_TIMEOUT = 1.0
OPEN = {"/health", "/ping"}


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server(api_keys=(KEY,), header_timeout=HEADER_TIMEOUT,
                           body_timeout=BODY_TIMEOUT)
    yield running
    running.stop()


def routes(srv: RunningServer) -> list[tuple[str, str]]:
    out = []
    for route in srv.app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_every_endpoint_but_health_needs_the_key(srv: RunningServer) -> None:
    found = routes(srv)
    paths = {p for _, p in found}
    assert {"/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json", "/version",
            "/metrics", "/v1/models", "/v1/completions"} <= paths
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        for method, path in found:
            r = http.request(method, path)
            if path in OPEN:
                assert r.status_code == 200, (method, path, r.status_code)
            else:
                err = assert_error(r, 401)
                assert err["type"] == "AuthenticationError", (method, path)
            r = http.request(method, path, headers=AUTH)
            assert r.status_code != 401, (method, path)
        assert http.get("/metrics", headers=AUTH).status_code == 200
        assert http.get("/openapi.json", headers=AUTH).json()["info"]["title"] == "specserve"


def test_metrics_open_only_with_the_flag() -> None:
    from fastapi.testclient import TestClient

    from engine.args import EngineArgs
    from server.app import build_app
    from server.config import ServerConfig
    from srvutil import ENGINE_DEFAULTS

    cfg = EngineArgs(**ENGINE_DEFAULTS).create_engine_config()

    def never() -> Any:
        raise AssertionError("the engine is not built without the lifespan")

    for flag in (False, True):
        app = build_app(ServerConfig((MODEL,), api_keys=(KEY,), metrics_without_auth=flag),
                        cfg, never)
        client = TestClient(app)  # no `with`: no lifespan, no engine
        assert client.get("/metrics").status_code == (200 if flag else 401)
        assert client.get("/metrics", headers=AUTH).status_code == 200
        assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
        assert client.get("/version").status_code == 401
        assert client.get("/ping").status_code == 503  # open, the model is not loaded


class CountingTokenizer:
    """Delegates to the real tokenizer, counting ``encode`` calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.encodes = 0

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.encodes += 1
        return self._inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_text_too_long_is_refused_before_tokenizing(srv: RunningServer) -> None:
    tokens = srv.state.ctx.tokens
    bound = tokens.max_text_chars
    assert bound is not None and bound >= srv.state.ctx.max_model_len
    counting = CountingTokenizer(tokens.tokenizer)
    tokens.tokenizer = counting
    try:
        long = "a" * (bound + 1)
        msg = [{"role": "user", "content": long}]
        with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as http:
            for path, body, param in [
                    ("/v1/completions", {"model": MODEL, "prompt": long}, "prompt"),
                    ("/v1/completions", {"model": MODEL, "prompt": ["Hi", long]}, "prompt"),
                    ("/v1/chat/completions", {"model": MODEL, "messages": msg}, "messages"),
                    ("/v1/chat/completions", {"model": MODEL, "messages": msg,
                                              "stream": True}, "messages"),
                    ("/tokenize", {"model": MODEL, "prompt": long}, "prompt"),
                    ("/tokenize", {"model": MODEL, "messages": msg}, "messages")]:
                err = assert_error(http.post(path, json=body), 400, param=param,
                                   contains="maximum context length")
                assert "characters" in err["message"]
            assert counting.encodes == 0
            r = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
            assert r.status_code == 200 and counting.encodes == 1
    finally:
        tokens.tokenizer = counting._inner


def test_text_bound_is_sound() -> None:
    """No text of C characters has fewer than C / L tokens (L: longest vocabulary string)."""
    import random

    from models.hf_folder import load_tokenizer
    from models.resolve import resolve_model_path
    from server.tokens import longest_token_chars

    tok = load_tokenizer(resolve_model_path(MODEL))
    longest = longest_token_chars(tok)
    assert longest == max(len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))))
    rng = random.Random(0)
    alphabet = [" ", "\n", "#", "-", "a", "é", "中", "😀", "<|im_start|>", "\t", "0"]
    texts = ["#" * 5000, " " * 5000, "\n" * 3000, "ab" * 2000]
    texts += ["".join(rng.choice(alphabet) * rng.randint(1, 90) for _ in range(200))
              for _ in range(20)]
    for text in texts:
        assert len(tok.encode(text, add_special_tokens=False)) * longest >= len(text)


def test_content_type_must_be_json(srv: RunningServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            for ctype in ("text/plain", "application/x-www-form-urlencoded",
                          "multipart/form-data; boundary=x", None):
                headers = {"Content-Type": ctype} if ctype else {}
                err = assert_error(http.post(path, content=body, headers=headers), 415)
                assert "application/json" in err["message"]
        r = http.post("/v1/completions", content=body,
                      headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "stream", "yes"), ("/v1/completions", "max_tokens", "10"),
    ("/v1/completions", "seed", "42"), ("/v1/completions", "n", "2"),
    ("/v1/completions", "temperature", "0.5"), ("/v1/completions", "echo", 1),
    ("/v1/completions", "logprobs", True), ("/v1/completions", "stream", 1),
    ("/v1/chat/completions", "stream", "true"), ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "max_completion_tokens", "5"),
    ("/v1/chat/completions", "top_p", "1"), ("/tokenize", "add_special_tokens", "no"),
])
def test_strict_types(srv: RunningServer, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, field: value}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    if path == "/tokenize":
        del body["max_tokens"]
    assert_error(httpx.post(srv.url(path), json=body, headers=AUTH, timeout=60), 400,
                 param=field)


def test_numbers_stay_numbers(srv: RunningServer) -> None:
    r = httpx.post(srv.url("/v1/completions"), headers=AUTH, timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0, "top_p": 1})
    assert r.status_code == 200, r.text  # an integer is a valid float


def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    start = time.monotonic()
    sock.settimeout(limit)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            raise AssertionError(f"the server kept the connection for {limit}s: {data!r}")
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def _connect(srv: RunningServer) -> socket.socket:
    host, port = srv.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_slow_headers_are_cut_off(srv: RunningServer) -> None:
    with _connect(srv) as idle, _connect(srv) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(HEADER_TIMEOUT / 2)
        slow.sendall(b"X-Slow: 1\r\n")  # trickling bytes do not extend the deadline
        data, elapsed = _read_until_closed(slow, HEADER_TIMEOUT + 5)
        assert data.startswith(b"HTTP/1.1 408"), data
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == 408
        assert elapsed < HEADER_TIMEOUT + 2
        data, _ = _read_until_closed(idle, HEADER_TIMEOUT + 5)  # never sent a byte:
        assert data == b""  # closed without an answer nobody asked for


def test_slow_body_is_cut_off(srv: RunningServer) -> None:
    with _connect(srv) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        data, elapsed = _read_until_closed(sock, BODY_TIMEOUT + 5)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b'"code":408' in data.replace(b" ", b"")
        assert elapsed < BODY_TIMEOUT + 2


@pytest.mark.parametrize("raw", [
    b"HELLO\r\n\r\n",
    b"GET /v1/mod\xc3\xa9ls HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
], ids=["request-line", "non-ascii-target", "header-name", "content-length", "chunk-size"])
def test_unparsable_http_gets_a_json_400(srv: RunningServer, raw: bytes) -> None:
    with _connect(srv) as sock:  # uvicorn's own answer was text/plain
        sock.sendall(raw)
        data, _ = _read_until_closed(sock, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data
    assert b"content-type: application/json" in head.lower(), head
    assert json.loads(body)["error"]["code"] == 400


def test_client_leaving_mid_body_is_not_a_server_error(
        srv: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("ERROR", logger="specserve.server"):
        for tail in (b"", b"\r\nZZ\r\n"):  # gone mid-body; a bad chunk h11 answers itself
            with _connect(srv) as sock:
                te = b"Transfer-Encoding: chunked" if tail else b"Content-Length: 100"
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nAuthorization: Bearer " + KEY.encode()
                             + b"\r\n" + te + b"\r\n\r\n" + (tail or b'{"prompt": '))
                time.sleep(0.3)
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_keep_alive_survives_a_slow_client_elsewhere(srv: RunningServer) -> None:
    with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=30) as http:
        assert http.get("/v1/models").status_code == 200
        time.sleep(HEADER_TIMEOUT + 0.5)  # an idle keep-alive connection is not a slow client
        assert http.get("/v1/models").status_code == 200


def test_generation_tokens_move_every_step(srv: RunningServer) -> None:
    before = srv.metrics()["vllm:generation_tokens_total{}"]
    seen = threading.Event()
    done = threading.Event()
    mid: dict[str, float] = {}

    def stream() -> None:
        with httpx.stream("POST", srv.url("/v1/completions"), headers=AUTH, timeout=60, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 60,
                "ignore_eos": True, "stream": True}) as s:
            chunks = 0
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 20:
                        mid["value"] = srv.metrics()["vllm:generation_tokens_total{}"]
                        mid["running"] = srv.state.engine.snapshot.running
                        seen.set()
            done.set()

    t = threading.Thread(target=stream)
    t.start()
    assert seen.wait(60)
    t.join(60)
    assert done.is_set()
    assert mid["running"] == 1  # still generating when scraped
    assert mid["value"] - before >= 15
    assert srv.metrics()["vllm:generation_tokens_total{}"] - before == 60
