"""``--limit-concurrency`` (issue 17): in-flight requests past the limit get a JSON 503 with
Retry-After; streams count until they end; idle connections and health checks do not count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from srvutil import MODEL, RunningServer, assert_error, start_server

from server.http_utils import ConcurrencyLimitMiddleware

LIMIT = 2


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server(limit_concurrency=LIMIT)
    yield running
    running.stop()


def _stream_body(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True,
            "stream": True}


def _wait_for_slot(http: httpx.Client, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = http.get("/v1/models")
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_streams_hold_slots_and_refusals_are_json(srv: RunningServer) -> None:
    with srv.http() as a, srv.http() as b, srv.http() as c:
        # idle keep-alive connections take no slot (uvicorn's limit counted them)
        assert a.get("/v1/models").status_code == 200
        assert b.get("/v1/models").status_code == 200
        assert c.get("/v1/models").status_code == 200
        with a.stream("POST", "/v1/completions", json=_stream_body(0)) as s0, \
                b.stream("POST", "/v1/completions", json=_stream_body(1)) as s1:
            assert s0.status_code == s1.status_code == 200
            lines = [s0.iter_lines(), s1.iter_lines()]  # kept: a dropped iterator closes
            assert all(next(it).startswith("data: ") for it in lines)  # both are streaming
            refused = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 1})
            assert_error(refused, 503, contains="--limit-concurrency")
            assert refused.headers["retry-after"] == "1"
            assert_error(c.get("/v1/models"), 503)
            assert c.get("/health").status_code == 200  # exempt, on the same connection
            assert c.get("/metrics").status_code == 200
        # the two clients went away mid-stream: their slots come back
        assert _wait_for_slot(c).status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_middleware_counts_until_the_response_is_sent() -> None:
    release = asyncio.Event()
    sent: list[tuple[str, int]] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/slow":
            await release.wait()  # a stream that has not finished yet
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    limited = ConcurrencyLimitMiddleware(app, limit=1)

    async def call(path: str) -> None:
        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent.append((path, message["status"]))

        await limited({"type": "http", "path": path, "method": "GET", "headers": []},
                      receive, send)

    async def scenario() -> None:
        first = asyncio.ensure_future(call("/slow"))
        await asyncio.sleep(0)
        assert limited.in_flight == 1
        await call("/v1/models")
        await call("/health")
        release.set()
        await first
        assert limited.in_flight == 0
        await call("/v1/models")

    asyncio.run(scenario())
    assert sent == [("/slow", 200), ("/v1/models", 503), ("/health", 200), ("/v1/models", 200)]
