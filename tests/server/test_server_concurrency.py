"""Many concurrent streams, some clients disconnecting: the rest finish and the KV cache
is fully released."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from srvutil import MODEL, RunningServer, start_server

N_CLIENTS = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


def wait_idle(srv: RunningServer, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if (m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
                and m["vllm:kv_cache_usage_perc{}"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine did not go idle: {m}")
        time.sleep(0.05)


async def _client(http: httpx.AsyncClient, i: int, disconnect: bool) -> dict:
    chat = i % 2 == 1
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0 if i % 4 else 0.7, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Count to {i + 3}."}]
    else:
        body["prompt"] = f"Story number {i}: once upon a time"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events: list = []
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        buffer = ""
        async for text in r.aiter_text():
            buffer += text
            while "\n\n" in buffer:
                block, buffer = buffer.split("\n\n", 1)
                assert block.startswith("data: ")
                data = block[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
            content = [e for e in events if e != "[DONE]" and e["choices"]]
            if disconnect and len(content) >= 2:
                return {"i": i, "disconnected": True}
    return {"i": i, "disconnected": False, "events": events, "chat": chat}


def test_concurrent_streams_with_disconnects(srv: RunningServer) -> None:
    before = wait_idle(srv)

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=N_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=180, limits=limits) as http:
            return await asyncio.gather(*[_client(http, i, i % 3 == 0)
                                          for i in range(N_CLIENTS)])

    results = asyncio.run(run())
    dropped = [r for r in results if r["disconnected"]]
    assert len(dropped) == len(range(0, N_CLIENTS, 3))
    for r in results:
        if r["disconnected"]:
            continue
        events = r["events"]
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1]), finishes
        if r["chat"]:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    after = wait_idle(srv)
    aborted = after['vllm:request_success_total{finished_reason="abort"}'] - \
        before['vllm:request_success_total{finished_reason="abort"}']
    length = after['vllm:request_success_total{finished_reason="length"}'] - \
        before['vllm:request_success_total{finished_reason="length"}']
    # a dropped client may (rarely) finish before its abort lands
    assert 1 <= aborted <= len(dropped)
    assert aborted + length == N_CLIENTS
    assert srv.state.engine.num_streams == 0


def test_non_streaming_disconnect_aborts(srv: RunningServer) -> None:
    before = wait_idle(srv)
    body = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 400,
            "ignore_eos": True}
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url("/v1/completions"), json=body, timeout=1.0)
    after = wait_idle(srv, timeout=20)
    assert time.monotonic() - start < 20  # 400 tokens would take far longer
    assert after['vllm:request_success_total{finished_reason="abort"}'] == \
        before['vllm:request_success_total{finished_reason="abort"}'] + 1
    ok = httpx.post(srv.url("/v1/completions"), json={**body, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
