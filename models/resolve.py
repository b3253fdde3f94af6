"""Turn a user-supplied model name or path into a local Hugging Face folder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from models.gguf_import import ensure_smollm2_folder

DEFAULT_MODEL = "smollm2-135m-instruct"

ModelProvider = Callable[[], Path]

# Read-only: built-in model name -> function that returns (and if needed creates) its folder.
BUILTIN_MODELS: Mapping[str, ModelProvider] = MappingProxyType(
    {DEFAULT_MODEL: ensure_smollm2_folder}
)

# Read-only: other spellings (lower-cased) accepted for a built-in model.
BUILTIN_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "huggingfacetb/smollm2-135m-instruct": DEFAULT_MODEL,
    }
)


class UnknownModelError(ValueError):
    """The name is neither a built-in model nor a usable local model folder."""


def builtin_model_name(name: str) -> str | None:
    """Canonical built-in name for ``name`` (case-insensitive, aliases accepted), else None."""
    key = name.strip().lower()
    if key in BUILTIN_MODELS:
        return key
    return BUILTIN_ALIASES.get(key)


def _unknown(name_or_path: str, detail: str) -> UnknownModelError:
    builtins = ", ".join(sorted(BUILTIN_MODELS))
    return UnknownModelError(
        f"Model {name_or_path!r} is neither a built-in model ({builtins}) nor a local directory "
        f"with config.json ({detail}); pass a path to a Hugging Face model folder"
    )


def resolve_model_path(name_or_path: str) -> Path:
    """Resolve a built-in model name or a local Hugging Face folder to a directory path.

    Built-in names are matched case-insensitively and imported on first use. Any other value
    must be an existing directory containing ``config.json``.
    """
    builtin = builtin_model_name(name_or_path)
    if builtin is not None:
        return BUILTIN_MODELS[builtin]()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise _unknown(name_or_path, "no such path")
    if not path.is_dir():
        raise _unknown(name_or_path, "it is a file, not a directory")
    if not (path / "config.json").is_file():
        raise _unknown(name_or_path, f"{path / 'config.json'} is missing")
    return path.resolve()
