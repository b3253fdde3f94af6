"""specserve's OpenAI-compatible HTTP server (FastAPI + uvicorn) and CLI."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("specserve")
except metadata.PackageNotFoundError:  # running from a source checkout
    __version__ = "0.1.0"
