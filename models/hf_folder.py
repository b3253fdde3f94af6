"""Read helpers for a Hugging Face model folder: config, RoPE, generation config, weights.

These helpers only parse files; they do not build any model. Every malformed input raises
``ModelConfigError`` naming the offending file or key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARDED_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
LLAMA3_ROPE_KEYS: tuple[str, ...] = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
_SAMPLING_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k")
_TOKEN_ID_KEYS: tuple[str, ...] = ("bos_token_id", "pad_token_id")


class ModelConfigError(ValueError):
    """A model folder's files are missing, malformed or describe something unsupported."""


# --------------------------------------------------------------------------- JSON


def _read_json_object(path: Path) -> dict[str, Any]:
    """Parse ``path`` as a JSON object, raising ModelConfigError with the path on failure."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ModelConfigError(
            f"{path} does not exist; is this a Hugging Face model folder?"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"Cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "fix or re-download the file"
        ) from exc
    if not isinstance(data, dict):
        raise ModelConfigError(
            f"{path} must contain a JSON object at the top level, not {type(data).__name__}"
        )
    return data


def load_hf_config(path: Path | str) -> dict[str, Any]:
    """Return the parsed ``config.json`` of the model folder at ``path``."""
    return _read_json_object(Path(path) / CONFIG_FILE)


# --------------------------------------------------------------------------- RoPE


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"RoPE parameter {key!r} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result) or result <= 0:
        raise ModelConfigError(f"RoPE parameter {key!r} must be positive and finite, got {value!r}")
    return result


def _rope_source(config: Mapping[str, Any]) -> tuple[float | None, Mapping[str, Any] | None]:
    """Pick (rope_theta, parameters dict) from either config style.

    transformers 5 writes ``rope_parameters`` (type, theta and scaling keys together);
    transformers 4 writes a top-level ``rope_theta`` plus an optional ``rope_scaling``.
    """
    params = config.get("rope_parameters")
    if params is None:
        params = config.get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise ModelConfigError(
            f"RoPE parameters must be a JSON object or null, got {type(params).__name__}"
        )
    theta = config.get("rope_theta")
    if params is not None and params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    return theta, params


def _rope_type(params: Mapping[str, Any] | None) -> str:
    if params is None:
        return "default"
    if params and all(isinstance(value, Mapping) for value in params.values()):
        raise ModelConfigError(
            f"Per-layer-type RoPE parameters ({', '.join(params)}) are not supported; "
            f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ModelConfigError(f"rope_type must be a string, got {rope_type!r}")
    return rope_type


def _llama3_scaling(params: Mapping[str, Any]) -> dict[str, Any]:
    missing = [key for key in LLAMA3_ROPE_KEYS if params.get(key) is None]
    if missing:
        raise ModelConfigError(
            f"llama3 RoPE scaling is missing {', '.join(missing)}; it needs "
            f"{', '.join(LLAMA3_ROPE_KEYS)}"
        )
    original = params["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ModelConfigError(
            f"original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    low = _as_float(params["low_freq_factor"], "low_freq_factor")
    high = _as_float(params["high_freq_factor"], "high_freq_factor")
    if high <= low:
        raise ModelConfigError(
            f"llama3 RoPE needs high_freq_factor > low_freq_factor, got {high} <= {low}"
        )
    return {
        "rope_type": "llama3",
        "factor": _as_float(params["factor"], "factor"),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def normalize_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``{"rope_theta": float, "rope_scaling": dict | None}`` for either config style.

    ``rope_scaling`` is None for plain RoPE and, for llama3 scaling, a dict with
    ``rope_type``, ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``. Other rope types raise ModelConfigError.
    """
    theta, params = _rope_source(config)
    rope_theta = DEFAULT_ROPE_THETA if theta is None else _as_float(theta, "rope_theta")
    rope_type = _rope_type(params)
    if rope_type == "default":
        return {"rope_theta": rope_theta, "rope_scaling": None}
    if rope_type == "llama3" and params is not None:
        return {"rope_theta": rope_theta, "rope_scaling": _llama3_scaling(params)}
    raise ModelConfigError(
        f"RoPE type {rope_type!r} is not supported; supported types: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )


# --------------------------------------------------------------------------- generation config


def _token_id_list(value: Any, path: Path) -> list[int]:
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ModelConfigError(
                f"eos_token_id in {path} must be a non-negative integer or a list of them, "
                f"got {value!r}"
            )
    return [int(item) for item in values]


def load_generation_config(path: Path | str) -> dict[str, Any]:
    """Read ``generation_config.json`` (``{}`` when absent).

    Returns ``eos_token_id`` as a list of ints, plus ``bos_token_id``, ``pad_token_id``,
    ``temperature``, ``top_p`` and ``top_k`` when the file sets them.
    """
    file = Path(path) / GENERATION_CONFIG_FILE
    if not file.is_file():
        return {}
    raw = _read_json_object(file)
    result: dict[str, Any] = {}
    if raw.get("eos_token_id") is not None:
        result["eos_token_id"] = _token_id_list(raw["eos_token_id"], file)
    for key in _TOKEN_ID_KEYS:
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            result[key] = value
    for key in _SAMPLING_KEYS:
        if raw.get(key) is not None:
            result[key] = raw[key]
    return result


# --------------------------------------------------------------------------- weights


def _shard_files(folder: Path) -> list[Path]:
    """Shard files named by ``model.safetensors.index.json``, in first-mention order."""
    index_path = folder / SHARDED_INDEX_FILE
    weight_map = _read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelConfigError(f"{index_path} has no 'weight_map' object naming the shard files")
    names = list(dict.fromkeys(str(name) for name in weight_map.values()))
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise ModelConfigError(
            f"{index_path} names shard files that are missing from {folder}: "
            f"{', '.join(missing)}; re-download the complete checkpoint"
        )
    return [folder / name for name in names]


def weight_files(path: Path | str) -> list[Path]:
    """The safetensors files of a model folder (single file or every shard)."""
    folder = Path(path)
    if (folder / SHARDED_INDEX_FILE).is_file():
        return _shard_files(folder)
    if (folder / SINGLE_WEIGHTS_FILE).is_file():
        return [folder / SINGLE_WEIGHTS_FILE]
    hint = ""
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        hint = " (PyTorch .bin/.pt checkpoints are not supported; convert them to safetensors)"
    raise ModelConfigError(
        f"No weights found in {folder}: expected {SINGLE_WEIGHTS_FILE} or "
        f"{SHARDED_INDEX_FILE}{hint}"
    )


def iter_safetensors(path: Path | str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight in the folder, one file open at a time."""
    from safetensors import SafetensorError, safe_open

    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:
            raise ModelConfigError(f"Cannot read weights from {file}: {exc}") from exc


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """Load the folder's tokenizer with transformers, never touching the network."""
    from transformers import AutoTokenizer

    folder = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelConfigError(
            f"Cannot load a tokenizer from {folder} ({exc}); the folder needs tokenizer.json "
            "and tokenizer_config.json"
        ) from exc
