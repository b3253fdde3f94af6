"""Cache dtype names and their torch dtypes."""

from __future__ import annotations

import torch

CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
)
_NAMED = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CacheDtypeError(ValueError):
    """An unknown cache dtype name."""


def check_cache_dtype(name: str) -> str:
    if name not in CACHE_DTYPES and name not in _NAMED:
        raise CacheDtypeError(
            f"Unknown kv cache dtype {name!r}; valid: {', '.join(CACHE_DTYPES)}"
        )
    return name


def resolve_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a cache dtype name to a torch dtype; ``auto`` is the model dtype."""
    check_cache_dtype(name)
    return model_dtype if name == "auto" else _NAMED[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
