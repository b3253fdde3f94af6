"""The CLI: help works, bad flags fail fast, and the image entrypoint command serves, drains
on SIGTERM (in-flight streams get a final event) and exits cleanly."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from srvutil import MODEL, free_port, sse_events

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def specserve() -> list[str]:
    """The installed console script, or exactly what it runs."""
    script = Path(sys.executable).with_name("specserve")
    if script.exists():
        return [str(script)]
    found = shutil.which("specserve")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())"]


def test_help() -> None:
    for args in (["--help"], ["serve", "--help"]):
        out = subprocess.run([sys.executable, "-m", "server", *args], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert "serve" in out.stdout
    serve_help = out.stdout
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--speculative-config",
                 "--max-model-len", "--kv-cache-dtype", "--kv-cache-layout", "--shutdown-timeout",
                 "--request-timeout", "--max-waiting-requests", "--max-logprobs"):
        assert flag in serve_help, flag


def test_bad_config_exits_with_2() -> None:
    out = subprocess.run([*specserve(), "serve", MODEL, "--max-model-len", "100000"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "max_model_len" in out.stderr


def test_entrypoint_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    cmd = [*specserve(), "serve", "--host", "0.0.0.0", "--port", str(port), "--max-model-len",
           "512", "--kv-cache-memory", "64MiB", "--speculative-config", "none", "--dtype",
           "float32", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(base + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
            if status == 200:
                break
            time.sleep(0.2)
        assert status == 200, proc.stdout.read() if proc.poll() is not None else "timeout"
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

        got: dict[str, list] = {}
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": "A long story:", "max_tokens": 400,
                    "ignore_eos": True, "stream": True}) as s:
                first.set()
                got["events"] = sse_events(s)

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(30)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        client.join(30)
        assert proc.wait(timeout=30) == 0
        events = got["events"]
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_caps_the_cpu_kernel_caches_unless_the_operator_set_them(monkeypatch) -> None:
    from server import cli

    env = {"LRU_CACHE_CAPACITY": "512"}
    cli.cap_kernel_caches(env)
    assert env == {"LRU_CACHE_CAPACITY": "512", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}

    # `serve` applies it before anything else runs (the caches read it on first use)
    class Applied(Exception):
        pass

    def applied(environ=None):
        raise Applied

    monkeypatch.setattr(cli, "cap_kernel_caches", applied)
    with pytest.raises(Applied):
        cli.main(["serve", MODEL])


def test_serve_flags_map_onto_engine_args() -> None:
    """Every ``serve`` engine flag reaches ``EngineArgs``, defaults included (graphs: on unless
    ``--enforce-eager``; they are only captured on CUDA with FlashInfer)."""
    import dataclasses

    from engine.args import EngineArgs
    from server.cli import engine_kwargs_from, make_parser

    args = make_parser().parse_args(["serve", "--device", "cpu"])
    kwargs = engine_kwargs_from(args, "m")
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    defaults = EngineArgs()
    assert kwargs["enforce_eager"] is False
    assert kwargs["max_cudagraph_capture_size"] == defaults.max_cudagraph_capture_size == 512
    args = make_parser().parse_args(["serve", "--device", "cpu", "--enforce-eager",
                                     "--max-cudagraph-capture-size", "64"])
    kwargs = engine_kwargs_from(args, "m")
    assert kwargs["enforce_eager"] is True and kwargs["max_cudagraph_capture_size"] == 64
