"""Attention backends, selected by name and imported lazily."""

from __future__ import annotations

import torch

from attention.backends.base import AttentionBackend, AttentionBatch, AttentionMetadata

BACKENDS: tuple[str, ...] = ("torch", "flashinfer")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here."""


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    key = name.strip().lower()
    if key in ("torch", "torch_ref", "sdpa"):
        from attention.backends.torch_backend import TorchBackend

        return TorchBackend()
    if key == "flashinfer":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailableError(
                "FlashInfer backend needs a CUDA device and the flashinfer package "
                "(pip install specserve[gpu]); use --attention-backend torch on CPU"
            )
        try:
            import flashinfer  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(
                "FlashInfer backend needs a CUDA device and the flashinfer package "
                "(pip install specserve[gpu]); the flashinfer package is not installed"
            ) from exc
        from attention.backends.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"Unknown attention backend {name!r}; valid: {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionBatch", "AttentionMetadata", "get_backend", "BACKENDS"]
