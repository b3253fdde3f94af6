"""Attention groups: every attention layer belongs to one group, and a group has one KV spec.

A layer declares its spec from the config its model was built with (the target from the base
cache config, the draft from a ``replace``d copy). Validation resolves each layer's cache dtype
string and requires one dtype, head count, head size and block size per group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from attention.dtypes import dtype_name, resolve_cache_dtype


class GroupValidationError(ValueError):
    """Layers of one group disagree, or a layer is in no group or in two."""


@dataclass(frozen=True)
class LayerKVSpec:
    """What one attention layer needs from the KV pool."""

    name: str
    group: str
    num_kv_heads: int
    head_size: int
    cache_dtype: str  # as configured: "auto", "bfloat16", "fp8", ...
    block_size: int


@dataclass(frozen=True)
class GroupSpec:
    """The resolved KV spec of one attention group."""

    name: str
    layers: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype: str

    @property
    def bytes_per_block_per_layer(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


def build_groups(
    specs: Iterable[LayerKVSpec], model_dtype: torch.dtype
) -> dict[str, GroupSpec]:
    """Validate layer specs and resolve one ``GroupSpec`` per group (in first-seen order)."""
    by_group: dict[str, list[LayerKVSpec]] = {}
    seen: dict[str, str] = {}
    for spec in specs:
        if not spec.group:
            raise GroupValidationError(f"Layer {spec.name!r} is not assigned to any attention group")
        if spec.name in seen:
            raise GroupValidationError(
                f"Layer {spec.name!r} is assigned to both {seen[spec.name]!r} and {spec.group!r}"
            )
        seen[spec.name] = spec.group
        by_group.setdefault(spec.group, []).append(spec)

    groups = {name: _resolve_group(name, layers, model_dtype) for name, layers in by_group.items()}
    block_sizes = {g.name: g.block_size for g in groups.values()}
    if len(set(block_sizes.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in block_sizes.items())
        raise GroupValidationError(
            "All attention groups share one block table and must use one block_size; "
            f"got {listing}"
        )
    return groups


def _resolve_group(name: str, layers: list[LayerKVSpec], model_dtype: torch.dtype) -> GroupSpec:
    dtypes = {s.name: resolve_cache_dtype(s.cache_dtype, model_dtype) for s in layers}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{layer}: {dtype_name(d)}" for layer, d in dtypes.items())
        raise GroupValidationError(
            f"Attention group {name!r} mixes KV cache dtypes ({listing}); all layers in one "
            "group must use one cache dtype"
        )
    for field in ("num_kv_heads", "head_size", "block_size"):
        values = {s.name: getattr(s, field) for s in layers}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"{layer}: {v}" for layer, v in values.items())
            raise GroupValidationError(
                f"Attention group {name!r} has inconsistent KV specs: {field} ({listing})"
            )
    first = layers[0]
    return GroupSpec(
        name=name,
        layers=tuple(s.name for s in layers),
        block_size=first.block_size,
        num_kv_heads=first.num_kv_heads,
        head_size=first.head_size,
        dtype=next(iter(dtypes.values())),
        cache_dtype=first.cache_dtype,
    )
