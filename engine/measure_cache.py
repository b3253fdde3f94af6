"""A small on-disk cache for startup measurements (dtype choice, step costs).

Entries live under ``$SPECSERVE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/specserve``, or
``~/.cache/specserve``) in ``measurements/``, one JSON file per key. A key digests everything
the measurement depends on, the machine included, so a cache copied to another machine (or a
new torch version, thread count or model shape) is simply a miss. A file that cannot be read
or parsed is ignored with a warning and measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("specserve.measure")


def cache_root() -> Path:
    explicit = os.environ.get("SPECSERVE_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specserve"


def machine_signature(device: torch.device) -> dict[str, Any]:
    """What a timing depends on besides the workload: processor, torch, threads, device."""
    sig: dict[str, Any] = {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
        # the instruction sets torch's kernels actually use (they can be capped by env vars)
        "isa": [torch.backends.cpu.get_cpu_capability(),
                os.environ.get("ATEN_CPU_CAPABILITY", ""), os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                os.environ.get("SPECSERVE_KERNEL_MARCH", "")],  # and this project's kernels'
        # which of this project's matrix products are switched on (side-by-side runs)
        "products": [os.environ.get("SPECSERVE_ONEDNN", ""),
                     os.environ.get("SPECSERVE_PANEL_LINEAR", ""),
                     os.environ.get("SPECSERVE_PAIR_PRODUCTS", "")],
    }
    if device.type == "cuda":
        sig["gpu"] = torch.cuda.get_device_name(device)
    else:
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            info = platform.processor()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        sig["cpu"] = hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:16]
    return sig


def cache_path(kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_root() / "measurements" / f"{kind}-{digest[:24]}.json"


def load(path: Path) -> dict[str, Any] | None:
    """The cached entry at ``path``; ``None`` when missing or unusable (logged)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable measurement cache %s (%s); measuring again", path, exc)
        return None


def save(path: Path, data: dict[str, Any]) -> None:
    """Write atomically; a read-only or full disk only costs a re-measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not write measurement cache %s: %s", path, exc)
