"""Graceful shutdown: draining refuses new work, in-flight streams end with an error event."""

from __future__ import annotations

import threading
import time

import httpx
from srvutil import MODEL, assert_error, sse_events, start_server


def test_drain_then_abort_in_flight() -> None:
    srv = start_server(shutdown_timeout=1.5)
    got: dict[str, list] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", srv.url("/v1/completions"), timeout=60, json={
                "model": MODEL, "prompt": "Write a long story.", "max_tokens": 400,
                "ignore_eos": True, "stream": True}) as s:
            first_chunk.set()
            got["events"] = sse_events(s)

    client = threading.Thread(target=stream)
    client.start()
    assert first_chunk.wait(30)
    time.sleep(0.3)
    srv.server.should_exit = True  # what SIGTERM does
    deadline = time.monotonic() + 5
    while not srv.state.draining and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.state.draining
    # new work is refused while the in-flight stream may still finish
    health = httpx.get(srv.url("/health"), timeout=5)
    assert health.status_code == 503
    assert_error(httpx.post(srv.url("/v1/completions"), timeout=5,
                            json={"model": MODEL, "prompt": "x", "max_tokens": 1}), 503)
    client.join(30)
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    events = got["events"]
    # an aborted stream ends with an error event, not with a finish_reason that looks final
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503 and "shutting down" in events[-2]["error"]["message"]
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-2] if e.get("choices")]
    assert finishes and all(f is None for f in finishes), finishes
