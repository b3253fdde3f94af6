"""Bounded waiting queue (503 + Retry-After) and the per-request timeout."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from srvutil import MODEL, RunningServer, assert_error, sse_events, start_server

TIMEOUT = 3.0
LONG = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 400,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server(engine={"max_num_seqs": 1, "max_waiting_requests": 1},
                           request_timeout=TIMEOUT)
    yield running
    running.stop()


def test_request_timeout_aborts(srv: RunningServer) -> None:
    start = time.monotonic()
    r = httpx.post(srv.url("/v1/completions"), json=LONG, timeout=60)
    elapsed = time.monotonic() - start
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert TIMEOUT <= elapsed < TIMEOUT + 10
    assert r.json()["usage"]["completion_tokens"] < 400
    with httpx.stream("POST", srv.url("/v1/chat/completions"), timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
        events = sse_events(s)
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finishes[-1] == "abort" and finishes.count("abort") == 1


def test_queue_full_gets_503_with_retry_after(srv: RunningServer) -> None:
    started = threading.Event()
    results: dict[str, int] = {}

    def long_stream(name: str) -> None:
        with httpx.stream("POST", srv.url("/v1/completions"), timeout=60,
                          json={**LONG, "stream": True}) as s:
            results[name] = s.status_code
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    started.set()

    running = threading.Thread(target=long_stream, args=("running",))
    running.start()
    assert started.wait(30)
    waiting = threading.Thread(target=long_stream, args=("waiting",))
    waiting.start()
    deadline = time.monotonic() + 10
    while srv.state.engine.snapshot.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = httpx.post(srv.url("/v1/completions"), json={**LONG, "max_tokens": 2}, timeout=30)
    err = assert_error(r, 503, contains="queue is full")
    assert err["type"] == "ServiceUnavailableError"
    assert int(r.headers["Retry-After"]) >= 1
    running.join(30)
    waiting.join(30)
    assert results == {"running": 200, "waiting": 200}
    ok = httpx.post(srv.url("/v1/completions"), json={**LONG, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert json.loads(ok.text)["choices"][0]["finish_reason"] == "length"
