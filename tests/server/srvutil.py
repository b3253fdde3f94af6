"""Helpers for the server tests: a real in-process uvicorn server on a free port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "smollm2-135m-instruct"
ALIAS = "smol"
ENGINE_DEFAULTS: dict[str, Any] = {
    "model": MODEL, "dtype": "float32", "max_model_len": 512, "kv_cache_memory": "64MiB",
    "speculative_config": None, "max_num_seqs": 64,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    app: Any
    server: Any
    thread: threading.Thread
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def state(self) -> Any:
        return self.app.state.specserve

    def url(self, path: str) -> str:
        return self.base_url + path

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=120, **kwargs)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        return scrape(self.base_url, self.headers)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``/metrics`` as {'name{label="v",...}': value} using prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base_url + "/metrics", timeout=30, headers=headers)
    assert r.status_code == 200, r.text
    text = r.text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k not in ("model_name", "engine"))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def start_server(engine_factory: Callable[[Any], Any] | None = None, *,
                 engine: dict[str, Any] | None = None, **server_kwargs: Any) -> RunningServer:
    from engine.args import EngineArgs
    from engine.engine import LLMEngine
    from server.app import build_app
    from server.config import ServerConfig
    from server.launch import make_server

    cfg = EngineArgs(**{**ENGINE_DEFAULTS, **(engine or {})}).create_engine_config()
    factory = engine_factory or LLMEngine
    server_kwargs.setdefault("served_model_names", (MODEL, ALIAS))
    server_kwargs.setdefault("log_stats_interval", 0.0)
    config = ServerConfig(**server_kwargs)
    app = build_app(config, cfg, lambda: factory(cfg))
    port = free_port()
    server = make_server(app, "127.0.0.1", port, "warning")
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    keys = config.api_keys
    running = RunningServer(f"http://127.0.0.1:{port}", app, server, thread,
                            api_key=keys[0] if keys else None,
                            headers={"Authorization": f"Bearer {keys[0]}"} if keys else {})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not thread.is_alive() or running.state.engine.state == "dead":
            raise RuntimeError(f"server failed to start: {running.state.engine.error}")
        try:
            if httpx.get(running.url("/health"), timeout=5).status_code == 200:
                return running
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    running.stop()
    raise RuntimeError("server did not become healthy in time")


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse a finished SSE body strictly: every event is ``data: ...\\n\\n``."""
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events.count("[DONE]") == 1
    return events


def assert_error(response: httpx.Response, status: int, param: str | None = "__any__",
                 contains: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"].endswith("Error")
    if param != "__any__":
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err
