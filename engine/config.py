"""Frozen configuration, resolved once from user arguments and passed down.

Values learned at runtime (number of KV blocks, the resolved layout) never go back into these
objects: the layout lives in ``CacheConfig.layout_cell``, a write-once cell every copy shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attention.dtypes import MODEL_DTYPES, check_cache_dtype
from attention.layout import LayoutCell, parse_layout


class ConfigError(ValueError):
    """An invalid engine argument; the message names the field and the allowed values."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelConfig:
    model: str  # as the user named it
    path: Path
    hf_config: dict = field(repr=False, hash=False, compare=False)
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    served_model_name: str
    seed: int = 0
    load_format: str = "auto"  # "dummy": random weights (benchmarks of model shapes, no files)
    # how bf16 weights are multiplied on the CPU (``models.layers.pack_weight``): measured at
    # startup, ``engine.dtype_choice.auto_products``
    products: str = "onednn"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks_override: int | None = None
    layout_request: str | None = None
    layout_cell: LayoutCell = field(default_factory=LayoutCell, compare=False)

    def __post_init__(self) -> None:
        check_cache_dtype(self.cache_dtype)
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}", "block_size")
        if self.layout_request is not None:
            parse_layout(self.layout_request)

    @property
    def layout(self) -> str:
        """The resolved KV layout; raises if the engine has not resolved it yet."""
        return self.layout_cell.get()


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}", name)


TREE_ORDERS = ("confidence", "fixed")  # SpeculativeConfig.tree_order
SPEC_METHODS = ("dflash", "dflash2", "ngram")  # dflash detects DFlash2 drafts; dflash2 requires one


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    kv_cache_dtype: str | None = None
    attention_backend: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # measured per-step choice of how many drafts each request verifies (engine.spec.controller);
    # False: every request drafts and verifies num_speculative_tokens (fixed K, experiments)
    adaptive: bool = True
    disable_by_batch_size: int | None = None  # no drafts while more requests than this sample
    # which drafts a DFlash block offers (engine.spec.tree): None = the draft's tree.json if it
    # ships one, else a chain; "chain"; a list of rank paths, e.g. [[0], [0, 0], [1]]; or a
    # tree.json's content, {"paths": [...], "conditional": [...]}
    tree: Any = field(default=None, hash=False, compare=False)
    # the order a tree's nodes are verified in: "confidence", each block's own (the product of
    # its slots' probabilities along a node's path, engine.spec.tree_order), or "fixed", the
    # tree's order
    tree_order: str = "confidence"

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """Accept a dict, a JSON string, ``None`` or the string ``"none"``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("", "none", "null", "off"):
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--speculative-config is not valid JSON: {exc}", "speculative_config"
                ) from exc
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object", "speculative_config")
        known = {f for f in cls.__dataclass_fields__}
        if "min_acceptance_length" in value:
            raise ConfigError(
                "speculative_config.min_acceptance_length was replaced by the adaptive controller, "
                "which decides per step from measured costs and acceptance whether drafts pay; "
                "drop the key (\"adaptive\": false keeps a fixed number of drafts)",
                "speculative_config.min_acceptance_length",
            )
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"Unknown speculative_config keys {unknown}; valid: {sorted(known)}",
                "speculative_config",
            )
        method = str(value.get("method", "")).lower()
        if method not in SPEC_METHODS:
            raise ConfigError(
                f"speculative_config.method {value.get('method')!r} is not supported; "
                f"valid: {', '.join(SPEC_METHODS)}",
                "speculative_config.method",
            )
        if method in ("dflash", "dflash2") and not value.get("model"):
            raise ConfigError(
                f"speculative_config.model is required for method {method!r} (a draft folder)",
                "speculative_config.model",
            )
        if value.get("kv_cache_dtype") is not None:
            try:
                check_cache_dtype(value["kv_cache_dtype"])
            except ValueError as exc:
                raise ConfigError(
                    f"speculative_config.kv_cache_dtype: {exc}", "speculative_config.kv_cache_dtype"
                ) from exc
        backend = value.get("attention_backend")
        if backend is not None and str(backend).lower() not in ("torch", "torch_ref", "sdpa",
                                                                 "flashinfer"):
            raise ConfigError(
                f"speculative_config.attention_backend {backend!r} is unknown; valid: torch, "
                "flashinfer",
                "speculative_config.attention_backend",
            )
        limit = value.get("disable_by_batch_size")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(
                f"speculative_config.disable_by_batch_size must be an integer >= 1, got {limit!r}",
                "speculative_config.disable_by_batch_size",
            )
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ConfigError(
                f"speculative_config.adaptive must be true or false, got {adaptive!r}",
                "speculative_config.adaptive",
            )
        k = value.get("num_speculative_tokens")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}",
                "speculative_config.num_speculative_tokens",
            )
        order = value.get("tree_order", "confidence")
        if order not in TREE_ORDERS:
            raise ConfigError(
                f"speculative_config.tree_order must be one of {', '.join(TREE_ORDERS)}, "
                f"got {order!r}", "speculative_config.tree_order")
        tree = value.get("tree")
        if tree is not None and tree != "chain":
            if method != "dflash":
                raise ConfigError(
                    f"speculative_config.tree needs method 'dflash' (a DFlash draft proposes "
                    f"every slot's alternatives at once), not {method!r}",
                    "speculative_config.tree",
                )
            from engine.spec.tree import TreeError, tree_from_json

            try:
                parsed = tree_from_json(tree)
            except TreeError as exc:
                raise ConfigError(f"speculative_config.tree: {exc} (or \"chain\")",
                                  "speculative_config.tree") from exc
            paths = [list(p) for p in parsed.paths]
            value = {**value, "tree": paths if parsed.conditional is None else
                     {"paths": paths, "conditional": list(parsed.conditional)}}
        return cls(**{**value, "method": method})


@dataclass(frozen=True)
class GraphConfig:
    """Static, padded target passes (``engine.graphs``) for steps whose every query is a
    row: decode, speculative verify and short prompt chunks. ``sizes`` are the token counts a
    step is padded up to, ascending; ``capture`` records each size as a CUDA graph once and
    replays it, while ``capture=False`` runs the same static buffers eagerly (how the CPU
    tests the padding; a real engine never does this)."""

    sizes: tuple[int, ...]
    capture: bool = True

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ConfigError(f"graph sizes must ascend from >= 1, got {self.sizes}",
                              "max_cudagraph_capture_size")

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest size holding ``num_tokens`` tokens (None: too many for any)."""
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None = None
    attention_backend: str = "torch"
    device: str = "cpu"
    tensor_parallel_size: int = 1  # > 1: the target is sharded over ranks (engine.distributed)
    graphs: GraphConfig | None = None  # None: every step runs eagerly


def parse_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """A model dtype by name; ``None`` for ``auto`` (resolved by measurement, see
    ``engine.dtype_choice``, once the model's shapes and the device are known)."""
    if isinstance(name, torch.dtype):
        if name not in MODEL_DTYPES.values():
            raise ConfigError(f"Unsupported model dtype {name}", "dtype")
        return name
    key = str(name).lower().removeprefix("torch.")
    key = {"half": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(key, key)
    if key == "auto":
        return None
    if key not in MODEL_DTYPES:
        raise ConfigError(
            f"Unsupported dtype {name!r}; valid: auto, {', '.join(MODEL_DTYPES)}", "dtype"
        )
    return MODEL_DTYPES[key]


def parse_memory(value: int | str) -> int:
    """Parse a byte count such as ``1073741824``, ``"512MiB"``, ``"2GiB"`` or ``"1.5GB"``."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    units = {"gib": 1 << 30, "gb": 10**9, "g": 1 << 30, "mib": 1 << 20, "mb": 10**6,
             "m": 1 << 20, "kib": 1 << 10, "kb": 10**3, "k": 1 << 10, "b": 1, "": 1}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: len(text) - len(unit)] if unit else text
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    raise ConfigError(
        f"Cannot parse memory size {value!r}; use bytes or a unit like 512MiB or 2GiB",
        "kv_cache_memory",
    )
