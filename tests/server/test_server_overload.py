"""Bounded waiting queue (503 + Retry-After; 400 for a request that can never fit) and the
per-request timeout (an error, never a success)."""

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


def test_request_timeout_is_an_error_not_a_success(srv: RunningServer) -> None:
    """A request past --request-timeout that had started generating: 504 (non-stream) or an
    SSE error event before [DONE] (stream); never finish_reason "abort"; counted."""
    key = 'specserve:request_timeouts_total{stage="generating"}'
    before = srv.metrics().get(key, 0.0)
    start = time.monotonic()
    r = httpx.post(srv.url("/v1/completions"), json=LONG, timeout=60)
    elapsed = time.monotonic() - start
    assert_error(r, 504, contains="timed out")
    assert TIMEOUT <= elapsed < TIMEOUT + 10
    with httpx.stream("POST", srv.url("/v1/chat/completions"), timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
        assert s.status_code == 200
        events = sse_events(s)
    assert events[-2]["error"]["code"] == 504 and "timed out" in events[-2]["error"]["message"]
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-2] if e.get("choices")]
    assert any(e["choices"][0]["delta"].get("content") for e in events[1:-2]), events[:3]
    assert all(f is None for f in finishes), finishes
    assert srv.metrics()[key] == before + 2
    # the aborted requests released everything: a short request runs at once
    ok = httpx.post(srv.url("/v1/completions"), json={**LONG, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_request_larger_than_the_queue_is_a_400(srv: RunningServer) -> None:
    """max_waiting_requests=1: a request of 2 sequences can never be queued (400 that says
    why), unlike a full queue (503, retry later)."""
    r = httpx.post(srv.url("/v1/completions"), json={**LONG, "max_tokens": 2, "n": 2},
                   timeout=30)
    err = assert_error(r, 400, param="n", contains="waiting queue holds at most 1")
    assert "Retry-After" not in r.headers, err
    r = httpx.post(srv.url("/v1/completions"),
                   json={**LONG, "max_tokens": 2, "prompt": ["a", "b"]}, timeout=30)
    assert_error(r, 400, param="prompt", contains="--max-waiting-requests")
    r = httpx.post(srv.url("/v1/chat/completions"), timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "n": 3})
    assert_error(r, 400, param="n", contains="waiting queue")
    ok = httpx.post(srv.url("/v1/completions"), json={**LONG, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


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
