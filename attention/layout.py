"""KV-cache physical layout: a write-once cell shared by every copy of the cache config.

The logical view of one layer's cache is ``[num_blocks, 2, block_size, kv_heads, head_dim]``.
``NHD`` stores it in that order; ``HND`` swaps the token and head axes in memory
(``[num_blocks, 2, kv_heads, block_size, head_dim]``). Results never depend on the layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

LAYOUTS: tuple[str, ...] = ("NHD", "HND")
_ALIASES = {"NHD": "NHD", "HND": "HND", "LBNHC": "NHD", "LBHNC": "HND"}
LAYOUT_ENV = "SPECSERVE_KV_CACHE_LAYOUT"


class LayoutError(ValueError):
    """An unknown, unsupported or conflicting KV-cache layout."""


class LayoutNotResolvedError(RuntimeError):
    """The layout was read before the engine resolved it."""


def parse_layout(name: str) -> str:
    """Normalise a layout name (accepts the aliases LBNHC and LBHNC)."""
    key = str(name).strip().upper()
    if key not in _ALIASES:
        raise LayoutError(
            f"Unknown KV cache layout {name!r}; valid: NHD, HND (aliases LBNHC, LBHNC)"
        )
    return _ALIASES[key]


class LayoutCell:
    """A write-once holder for the resolved layout.

    ``dataclasses.replace`` passes the same object to the copy, and ``copy``/``deepcopy`` return
    the cell itself, so every copy of a cache config sees one resolution.
    """

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value: str | None = None

    def __copy__(self) -> LayoutCell:
        return self

    def __deepcopy__(self, memo: dict) -> LayoutCell:
        return self

    def __repr__(self) -> str:
        return f"LayoutCell({self._value or 'unresolved'})"

    @property
    def is_resolved(self) -> bool:
        return self._value is not None

    def get(self) -> str:
        if self._value is None:
            raise LayoutNotResolvedError(
                "KV cache layout has not been resolved yet; the engine resolves it once after "
                "building all models and before allocating the KV pool"
            )
        return self._value

    def set(self, name: str) -> str:
        value = parse_layout(name)
        if self._value is not None and self._value != value:
            raise LayoutError(
                f"KV cache layout is already resolved to {self._value}; cannot change it to {value}"
            )
        self._value = value
        return value


def choose_layout(
    requested: str | None,
    backend_layouts: dict[str, Sequence[str]],
    env: dict[str, str] | None = None,
) -> tuple[str, str]:
    """Pick the layout every backend in use supports. Returns ``(layout, reason)``.

    Precedence: an explicit request (argument, else ``SPECSERVE_KV_CACHE_LAYOUT``), which every
    backend must support; else the first layout (in the first backend's order of preference)
    that all backends support; else NHD.
    """
    environ = os.environ if env is None else env
    source = "--kv-cache-layout"
    if requested is None and environ.get(LAYOUT_ENV):
        requested, source = environ[LAYOUT_ENV], LAYOUT_ENV
    if requested is not None:
        layout = parse_layout(requested)
        for backend, layouts in backend_layouts.items():
            if layout not in layouts:
                raise LayoutError(
                    f"KV cache layout {layout} requested by {source} is not supported by "
                    f"backend {backend!r} (supports: {', '.join(layouts)})"
                )
        return layout, f"requested by {source}"
    if not backend_layouts:
        return "NHD", "default"
    common = _common_layouts(backend_layouts.values())
    if not common:
        raise LayoutError(
            f"No KV cache layout is supported by every backend: {dict(backend_layouts)}"
        )
    return common[0], "preferred by the attention backends"


def _common_layouts(all_layouts: Iterable[Sequence[str]]) -> list[str]:
    lists = [list(layouts) for layouts in all_layouts]
    return [lay for lay in lists[0] if all(lay in other for other in lists[1:])]
