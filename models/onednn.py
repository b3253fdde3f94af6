"""oneDNN's matmul called directly for the CPU's packed weights (``models/csrc/onednn_linear.cpp``).

PyTorch reaches oneDNN through ideep, whose per-call work (descriptors, a hashed cache key,
tensor wrappers) costs about 20 us per product, and ~120 products make a SmolLM2-135M decode
step. This extension reorders a weight once and keeps one oneDNN primitive per row count and
shape, shared by every weight of that shape (least recently used dropped past
``SPECSERVE_ONEDNN_CACHE`` entries, default 1024, about 140 KiB each), so a call costs a few
microseconds beyond the kernel. It links the ``onednn-cpu-gomp`` wheel's
library (oneDNN built with GNU OpenMP: it shares the OpenMP runtime torch loaded, hence its
thread count) and is built like the attention kernels, on first use or by ``make setup``.

A weight is packed here only when oneDNN's kernels give every row the same bits whatever the
row count among the counts a call may run as, measured per weight shape (:func:`row_range`):
calls are padded up to that range and to a few fixed counts within it, or split into such
calls (``onednn_linear.cpp``), so the product is row-count invariant everywhere, one row needs
no padding (``layers.linear``), and each weight shape has at most ~70 primitives, all made by
the probe (a new row count's primitive took about 1 ms to make: a prefill chunk or a draft's
context catch-up of an odd length paid it on the spot).
Without AMX the brgemm kernels are invariant at every count measured; with AMX, oneDNN runs one
or two rows of some shapes on AVX-512 kernels and some counts from about 150 rows on with
another blocking, each rounding differently. Where no range holds (the gemm fallback, e.g.
float32 on an AVX2 CPU with this oneDNN), :func:`pack` returns ``None`` and the caller keeps
PyTorch's packed path. ``SPECSERVE_ONEDNN=0`` turns this path off (for side-by-side
measurements).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "onednn_linear.cpp"]
_BUILD = Path(os.environ.get("SPECSERVE_ONEDNN_BUILD_DIR") or _CSRC / "build")
MAX_CALL_ROWS = 128  # a product's rows go to oneDNN in calls of at most this many (if invariant)
PROBE_OFFSET = 5  # the probe also compares windows starting at this row
_lock = threading.Lock()
_state: dict = {"module": None, "error": None, "probed": {}}


def enabled() -> bool:
    return os.environ.get("SPECSERVE_ONEDNN", "1") not in ("0", "false", "no", "off")


def onednn_root() -> Path | None:
    """The prefix holding oneDNN's headers and library: ``SPECSERVE_ONEDNN_ROOT``, else this
    Python environment's (where the wheels put ``include/`` and ``lib/``)."""
    for root in filter(None, (os.environ.get("SPECSERVE_ONEDNN_ROOT"), sys.prefix)):
        root = Path(root)
        if (root / "include" / "oneapi" / "dnnl" / "dnnl.hpp").exists() and \
                any((root / "lib").glob("libdnnl.so*")):
            return root
    return None


def load(verbose: bool = False):
    """The compiled module, or ``None`` (disabled, oneDNN not installed, or no compiler; the
    reason is logged once)."""
    if _state["module"] is not None or _state["error"] is not None:
        return _state["module"]
    with _lock:
        if _state["module"] is not None or _state["error"] is not None:
            return _state["module"]
        root = onednn_root()
        if root is None:
            _state["error"] = ("oneDNN not found (pip install onednn-cpu-gomp "
                               "onednn-devel-cpu-gomp, or set SPECSERVE_ONEDNN_ROOT)")
        else:
            from attention.cpu_kernel import build_extension

            lib = root / "lib"
            if not (lib / "libdnnl.so").exists():  # the linker wants the bare name
                _state["error"] = f"{lib}/libdnnl.so missing"
            else:
                try:
                    _state["module"] = build_extension(
                        "specserve_onednn", _SOURCES, _BUILD, include_dirs=[root / "include"],
                        ldflags=[f"-L{lib}", "-ldnnl", f"-Wl,-rpath,{lib}"], verbose=verbose)
                except Exception as exc:  # no compiler, build error: PyTorch's packed path
                    _state["error"] = f"{type(exc).__name__}: {exc}"
        if _state["error"] is not None:
            log.info("direct oneDNN products unavailable (PyTorch's packed path serves): %s",
                     _state["error"])
    return _state["module"]


def error() -> str | None:
    return _state["error"]


class DirectPacked:
    """A weight ``[out, in]`` packed for oneDNN's matmul; call it with rows ``[..., in]``."""

    __slots__ = ("op", "dtype")

    def __init__(self, op, dtype: torch.dtype) -> None:
        self.op = op
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.op.out_features, self.op.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.op.forward(x, bias)


def pack(weight: torch.Tensor) -> DirectPacked | None:
    """``weight`` packed for the direct path, or ``None`` where it does not serve: disabled, not
    built, not a CPU float32/bfloat16 weight, no oneDNN kernel for it on this CPU, or kernels
    whose rows depend on the row count (:func:`row_range` finds no range). Probed once per
    shape and dtype: oneDNN must pick brgemm kernels (one inner loop for every row count) for
    1, 2, 8 and 64 rows, and the bits must hold over a range of row counts."""
    if not enabled() or weight.device.type != "cpu" or \
            weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    mod = load()
    if mod is None:
        return None
    key = (tuple(weight.shape), weight.dtype)
    if _state["probed"].get(key) is False:
        return None
    try:
        op = mod.PackedLinear(weight.detach())
        if key not in _state["probed"]:
            kernels = sorted({op.impl(rows) for rows in (1, 2, 8, 64)})
            found = row_range(op, weight.dtype) if all(k.startswith("brg") for k in kernels) \
                else None
            _state["probed"][key] = found or False
            if found is None:
                log.info("oneDNN kernels %s for %s %s round a row differently by row count; "
                         "PyTorch's packed path serves", kernels, list(weight.shape),
                         weight.dtype)
                return None
            if found != (1, MAX_CALL_ROWS):
                log.info("oneDNN products %s %s in calls of %d..%d rows (kernels %s)",
                         list(weight.shape), weight.dtype, *found, kernels)
    except RuntimeError as exc:  # oneDNN has no kernel for this dtype on this CPU
        _state["probed"][key] = False
        log.info("no oneDNN matmul for %s %s here (%s); the panel kernel (bf16) or PyTorch's "
                 "packed path serves",
                 list(weight.shape), weight.dtype, exc)
        return None
    op.set_row_range(*_state["probed"][key])
    return DirectPacked(op, weight.dtype)


def call_counts(op, hi: int) -> list[int]:
    """The row counts below ``hi`` that a call may run as once a range ending at ``hi`` is set,
    as ``PackedLinear.call_rows`` rounds them (every count to 64, then multiples of 16; asked of
    ``op`` before its range is set). :func:`row_range` compares all of them."""
    return sorted({op.call_rows(n) for n in range(1, hi)} - {hi})


def row_range(op, dtype: torch.dtype) -> tuple[int, int] | None:
    """``(lo, hi)``: every row count a call runs as within ``lo..hi`` (:func:`call_counts`)
    gives each row the same bits as one call of ``hi`` rows, measured on heavy-tailed random
    rows (as a model's activations are), and a call of ``hi`` rows starting
    :data:`PROBE_OFFSET` rows later gives the shared rows the same bits; ``hi`` is
    :data:`MAX_CALL_ROWS` or the largest half of it that holds with ``hi >= 2 * lo``. ``None``:
    no such range (a kernel that is not invariant at all)."""
    gen = torch.Generator().manual_seed(0)
    width = op.in_features
    x = (torch.randn(MAX_CALL_ROWS + PROBE_OFFSET, width, generator=gen)
         * torch.rand(MAX_CALL_ROWS + PROBE_OFFSET, width, generator=gen).pow(4) * 8).to(dtype)
    hi = MAX_CALL_ROWS
    with torch.inference_mode():
        while hi >= 2:
            ref = op.forward(x[:hi])
            shifted = op.forward(x[PROBE_OFFSET:PROBE_OFFSET + hi])
            bad = [rows for rows in call_counts(op, hi)
                   if not torch.equal(op.forward(x[:rows]), ref[:rows])]
            lo = max(bad, default=0) + 1
            if torch.equal(shifted[:hi - PROBE_OFFSET], ref[PROBE_OFFSET:]) and 2 * lo <= hi:
                return lo, hi
            hi //= 2
    return None


if __name__ == "__main__":  # make setup: build once, loudly
    logging.basicConfig(level=logging.INFO)
    if os.environ.get("SPECSERVE_SKIP_KERNEL_BUILD"):
        raise SystemExit(0)
    if load(verbose=True) is None:
        print(f"note: direct oneDNN products not built ({error()}); PyTorch's packed path serves")
    else:
        print(f"direct oneDNN products built (oneDNN {load().version()})")
