"""The CPU kernels (``attention/csrc/``), one torch extension built on first use: the paged
attention (``paged_attention.cpp``) and a decoder layer's elementwise steps (``layer_ops.cpp``:
RMSNorm with the residual add fused in, SiLU(gate) * up, RoPE of Q and K) and the greedy
choice of a token (``sampling_ops.cpp``: argmax over the vocabulary) and bf16 matrix products
for CPUs whose oneDNN has no native bf16 (``linear_ops.cpp``, ``models/panel_linear.py``).

``make setup`` builds it once (``python -m attention.cpu_kernel``); otherwise the first call
builds it (about a minute on two cores) into ``attention/csrc/build/``. When no compiler is
available, ``load()`` returns ``None``: the torch backend keeps its SDPA path and the layers
their PyTorch ops.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / name for name in ("module.cpp", "paged_attention.cpp", "layer_ops.cpp",
                                            "sampling_ops.cpp", "linear_ops.cpp")]
_BUILD = Path(os.environ.get("SPECSERVE_KERNEL_BUILD_DIR")
              or Path(__file__).resolve().parent / "csrc" / "build")
# The instruction set the kernels are compiled for: this CPU's by default; e.g. ``x86-64-v3``
# (AVX2, no AVX-512) to build for older machines or to test that path on a newer one (pair it
# with its own SPECSERVE_KERNEL_BUILD_DIR).
_MARCH = os.environ.get("SPECSERVE_KERNEL_MARCH") or "native"
_FLAGS = ["-O3", f"-march={_MARCH}", "-mprefer-vector-width=512", "-ffp-contract=off", "-fopenmp"]
_lock = threading.Lock()
_module = None
_error: str | None = None


def load(verbose: bool = False):
    """The compiled module, or ``None`` if it cannot be built here (the reason is logged)."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            _module = build_extension("specserve_cpu_kernels", _SOURCES, _BUILD, verbose=verbose)
        except Exception as exc:  # no compiler, no ninja, build error: keep the SDPA path
            _error = f"{type(exc).__name__}: {exc}"
            log.warning("CPU kernels unavailable (SDPA attention, PyTorch layer ops): %s",
                        _error)
    return _module


def build_extension(name: str, sources: list[Path], build: Path, *, include_dirs=(),
                    ldflags=(), verbose: bool = False):
    """Build (once; torch's builder keeps the result in ``build``) and import a C++ extension
    compiled for this CPU with OpenMP; raises when it cannot be built."""
    from torch.utils.cpp_extension import load as load_ext

    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build)
    return load_ext(
        name=name,
        sources=[str(src) for src in sources],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp", *ldflags],
        extra_include_paths=[str(d) for d in include_dirs],
        build_directory=str(build),
        verbose=verbose,
    )


def _clear_stale_lock(build: Path, max_age_s: float = 600.0) -> None:
    """torch's extension builder waits forever on ``build/lock``; a build killed midway (Ctrl-C
    on first start) leaves it behind. A build takes about a minute, so an old lock is stale."""
    lock = build / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            log.warning("removing stale kernel build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def available() -> bool:
    return load() is not None


def error() -> str | None:
    return _error


def paged_attention(q: torch.Tensor, cache_logical: torch.Tensor, block_tables: torch.Tensor,
                    q_indptr: torch.Tensor, kv_lens: torch.Tensor, causal: bool, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0, tile: int = 16,
                    tree_masks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of packed queries ``q [N, Hq, D]`` over one layer's pages.

    ``cache_logical`` is the layer's ``[blocks, 2, bs, Hkv, D]`` view (either layout);
    ``block_tables [B, M]``, ``q_indptr [B+1]``, ``kv_lens [B]`` are int64. Query ``i`` of
    request ``b`` sits at position ``kv_len - q_len + i`` and, when ``causal``, sees positions up
    to its own; otherwise all ``kv_len``. ``tree_masks`` (``[N]`` int64, causal only) restricts
    a row's query-block positions to the set bits of its entry (0: causal; see
    ``AttentionBatch.tree_masks``), bitwise as a causal row over the same K/V in logical order.
    Returns ``[N, Hq, D]`` in ``q``'s dtype.
    """
    mod = load()
    if mod is None:
        raise RuntimeError(f"CPU paged-attention kernel unavailable: {_error}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        q = q.float()
    return mod.paged_attention(q.contiguous(), cache_logical, block_tables, q_indptr, kv_lens,
                               causal, float(scale), float(k_scale), float(v_scale), tile,
                               tree_masks)


if __name__ == "__main__":  # make setup: build once, loudly
    logging.basicConfig(level=logging.INFO)
    if os.environ.get("SPECSERVE_SKIP_KERNEL_BUILD"):
        raise SystemExit(0)
    if load(verbose=True) is None:
        print(f"warning: CPU paged-attention kernel not built ({_error}); SDPA will be used")
    else:
        print("CPU paged-attention kernel built")
