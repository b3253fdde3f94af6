"""A failing engine step fails every in-flight request (500 / error event) and turns
/health to 503; the HTTP server itself stays up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from srvutil import MODEL, RunningServer, assert_error, sse_events, start_server

from engine.engine import LLMEngine

POISON = [7, 7, 7, 7]  # a prompt whose add_requests raises an unexpected error


class FaultyEngine(LLMEngine):
    """The real engine, plus a switch that makes ``step()`` raise, and a prompt that makes
    ``add_requests`` raise."""

    fail = threading.Event()

    def add_requests(self, requests):  # type: ignore[override]
        if any(list(ids) == POISON for _, ids, _, _ in requests):
            raise RuntimeError("injected add_request failure")
        return super().add_requests(requests)

    def step(self):  # type: ignore[override]
        if self.fail.is_set():
            raise RuntimeError("injected engine failure")
        return super().step()


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    FaultyEngine.fail = threading.Event()
    running = start_server(FaultyEngine)
    yield running
    running.stop()


def test_one_bad_request_does_not_hurt_others(srv: RunningServer) -> None:
    body = {"model": MODEL, "max_tokens": 2}
    for _ in range(2):
        assert_error(httpx.post(srv.url("/v1/completions"), json={**body, "prompt": POISON},
                                timeout=60), 500, contains="RuntimeError")
        ok = httpx.post(srv.url("/v1/completions"), json={**body, "prompt": "Hi"}, timeout=60)
        assert ok.status_code == 200
    assert httpx.get(srv.url("/health")).status_code == 200


def test_step_failure_fails_in_flight_requests(srv: RunningServer) -> None:
    long = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400,
            "ignore_eos": True}
    ok = httpx.post(srv.url("/v1/completions"), json={**long, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    results: dict[str, object] = {}
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", srv.url("/v1/completions"), timeout=60,
                          json={**long, "stream": True}) as s:
            streaming.set()
            results["stream"] = sse_events(s)

    def plain() -> None:
        results["plain"] = httpx.post(srv.url("/v1/chat/completions"), timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400,
            "ignore_eos": True})

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert streaming.wait(30)
    deadline = time.monotonic() + 10
    while srv.state.engine.snapshot.running < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    # both requests must be generating when the step fails; otherwise the plain request
    # would only meet an already dead engine and this test would prove nothing about it
    assert srv.state.engine.snapshot.running == 2
    FaultyEngine.fail.set()
    for t in threads:
        t.join(30)
    events = results["stream"]
    assert events[-1] == "[DONE]"
    assert any(e["choices"][0]["text"] for e in events[:-2]), "the stream had started"
    err = events[-2]["error"]
    assert err["code"] == 500 and "injected engine failure" in err["message"]
    assert_error(results["plain"], 500, contains="injected engine failure")  # type: ignore[arg-type]
    health = httpx.get(srv.url("/health"), timeout=5)
    assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
    assert_error(httpx.post(srv.url("/v1/completions"), json=long, timeout=5), 500)
    assert httpx.get(srv.url("/metrics"), timeout=5).status_code == 200
