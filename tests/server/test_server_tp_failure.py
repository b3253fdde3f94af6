"""A tensor-parallel worker lost while serving (TP=2 on a tiny random Llama, gloo): in-flight
and new requests are answered with an OpenAI-style JSON 503, /health turns 503, and the
``specserve serve`` process exits with status 1 and a log line naming the worker, within a
bounded time: never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from srvutil import MODEL, assert_error, free_port, sse_events, start_server

from engine.engine import LLMEngine
from tests.spec.helpers import save_target

ROOT = Path(__file__).resolve().parents[2]
BOUND = 30.0  # seconds from the kill to the error / the exit
ENGINE = {"max_model_len": 256, "kv_cache_memory": "8MiB", "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("tp-server") / "llama", "llama", seed=3)


def _wait(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_lost_worker_fails_in_flight_and_new_requests_with_503(tiny: Path) -> None:
    engines: list[LLMEngine] = []

    def factory(cfg):
        engines.append(LLMEngine(cfg))
        return engines[-1]

    srv = start_server(factory, engine={"model": str(tiny), **ENGINE})
    dead: list[str] = []
    srv.state._on_engine_dead = dead.append  # what `specserve serve` hooks to exit
    worker = engines[0].tp.procs[0]
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 240, "ignore_eos": True}
        ok = httpx.post(srv.url("/v1/completions"), json={**body, "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200, ok.text
        results: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", srv.url("/v1/completions"), timeout=60,
                              json={**body, "stream": True}) as s:
                results["stream"] = sse_events(s)

        def plain() -> None:
            results["plain"] = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        snap = lambda: srv.state.engine.snapshot  # noqa: E731
        assert _wait(lambda: snap().running == 2 and snap().generation_tokens > 8, 20)
        # freeze the worker: rank 0 blocks in the step's all-reduce, both requests unfinished
        os.kill(worker.pid, signal.SIGSTOP)
        time.sleep(0.3)
        assert snap().running == 2, "the requests finished before the worker was stopped"
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(BOUND)
        assert not any(t.is_alive() for t in threads), "a request hung after the worker died"
        assert time.monotonic() - t0 < BOUND
        events = results["stream"]
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError", err
        assert "worker rank 1" in err["message"] and "SIGKILL" in err["message"]
        assert_error(results["plain"], 503, contains="worker rank 1")  # type: ignore[arg-type]
        # new requests: refused with 503 too, and /health says why
        assert_error(httpx.post(srv.url("/v1/completions"), json=body, timeout=10), 503,
                     contains="SIGKILL")
        health = httpx.get(srv.url("/health"), timeout=5)
        assert health.status_code == 503 and "worker rank 1" in health.json()["error"]["message"]
        assert len(dead) == 1 and "worker rank 1" in dead[0]
    finally:
        srv.stop()
        for p in engines[0].tp.procs if engines and engines[0].tp else []:
            if p.exitcode is None:
                p.kill()


def _workers(pid: int) -> list[int]:
    """Pids of the spawned worker processes among ``pid``'s children (read from /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                out.append(int(child))
    return out


def test_serve_exits_when_an_idle_worker_dies(tiny: Path) -> None:
    """No request needed: the engine loop checks its workers while idle, so the process exits
    with status 1 and says which rank died and how."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", str(tiny), "--port", str(port),
           "--tensor-parallel-size", "2", "--max-model-len", "256", "--kv-cache-memory", "8MiB",
           "--speculative-config", "none", "--dtype", "float32", "--uvicorn-log-level",
           "warning", "--served-model-name", MODEL]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        assert _wait(lambda: proc.poll() is not None or healthy(), 120), "server did not start"
        assert proc.poll() is None, proc.stdout.read()
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 200, r.text
        workers = _workers(proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        try:
            code = proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {BOUND:.0f} s of losing a worker")
        elapsed = time.monotonic() - t0
        out = proc.stdout.read()
        assert code == 1, out
        assert "the engine died, the server exits with status 1" in out, out
        assert "worker rank 1" in out and "SIGKILL" in out, out
        assert elapsed < BOUND
        print(f"server exited {elapsed:.1f} s after its worker was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
