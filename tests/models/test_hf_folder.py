"""Tests for the Hugging Face folder read helpers (no real model needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from models.hf_folder import (
    ModelConfigError,
    iter_safetensors,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
    normalize_rope,
)

LLAMA3_SCALING: dict[str, Any] = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


# --------------------------------------------------------------------------- config.json


def test_load_hf_config_reads_object(tmp_path: Path) -> None:
    _write_json(tmp_path / "config.json", {"model_type": "llama", "hidden_size": 8})
    assert load_hf_config(tmp_path) == {"model_type": "llama", "hidden_size": 8}


def test_load_hf_config_missing_names_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=str(tmp_path / "config.json")):
        load_hf_config(tmp_path)


def test_load_hf_config_malformed_names_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama",', encoding="utf-8")
    with pytest.raises(ModelConfigError, match=r"config\.json is not valid JSON \(line 1"):
        load_hf_config(tmp_path)


def test_load_hf_config_rejects_non_object(tmp_path: Path) -> None:
    _write_json(tmp_path / "config.json", [1, 2])
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_hf_config(tmp_path)


# --------------------------------------------------------------------------- RoPE


def test_rope_transformers4_default() -> None:
    assert normalize_rope({"rope_theta": 100000.0, "rope_scaling": None}) == {
        "rope_theta": 100000.0,
        "rope_scaling": None,
    }


def test_rope_missing_everything_uses_llama_default() -> None:
    assert normalize_rope({}) == {"rope_theta": 10000.0, "rope_scaling": None}


def test_rope_transformers5_default() -> None:
    config = {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    assert normalize_rope(config) == {"rope_theta": 100000.0, "rope_scaling": None}


def test_rope_transformers4_llama3() -> None:
    config = {"rope_theta": 500000, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}}
    result = normalize_rope(config)
    assert result["rope_theta"] == 500000.0
    assert result["rope_scaling"] == {"rope_type": "llama3", **LLAMA3_SCALING}


def test_rope_transformers4_legacy_type_key() -> None:
    config = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}}
    assert normalize_rope(config)["rope_scaling"]["rope_type"] == "llama3"


def test_rope_transformers5_llama3() -> None:
    config = {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}
    }
    result = normalize_rope(config)
    expected = {"rope_type": "llama3", **LLAMA3_SCALING}
    assert result == {"rope_theta": 500000.0, "rope_scaling": expected}
    assert isinstance(result["rope_scaling"]["original_max_position_embeddings"], int)


def test_rope_llama3_missing_key_is_named() -> None:
    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    missing = "high_freq_factor, original_max_position_embeddings"
    with pytest.raises(ModelConfigError, match=missing):
        normalize_rope({"rope_parameters": params})


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"])
def test_rope_unsupported_type_names_supported(style: str) -> None:
    config = {style: {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 10000.0}
    with pytest.raises(ModelConfigError, match=r"'yarn' is not supported.*default, llama3"):
        normalize_rope(config)


def test_rope_bad_theta() -> None:
    with pytest.raises(ModelConfigError, match="rope_theta"):
        normalize_rope({"rope_theta": "big"})


# --------------------------------------------------------------------------- generation config


def test_generation_config_absent_is_empty(tmp_path: Path) -> None:
    assert load_generation_config(tmp_path) == {}


def test_generation_config_int_eos_becomes_list(tmp_path: Path) -> None:
    _write_json(
        tmp_path / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "do_sample": True},
    )
    assert load_generation_config(tmp_path) == {
        "eos_token_id": [2],
        "bos_token_id": 1,
        "temperature": 0.6,
        "top_p": 0.9,
    }


def test_generation_config_eos_list_and_top_k(tmp_path: Path) -> None:
    config = {"eos_token_id": [128001, 128009], "top_k": 50}
    _write_json(tmp_path / "generation_config.json", config)
    assert load_generation_config(tmp_path) == {"eos_token_id": [128001, 128009], "top_k": 50}


def test_generation_config_bad_eos(tmp_path: Path) -> None:
    _write_json(tmp_path / "generation_config.json", {"eos_token_id": ["</s>"]})
    with pytest.raises(ModelConfigError, match="eos_token_id"):
        load_generation_config(tmp_path)


def test_generation_config_malformed(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(ModelConfigError, match="generation_config.json is not valid JSON"):
        load_generation_config(tmp_path)


# --------------------------------------------------------------------------- safetensors


def _tiny_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=generator),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=generator),
        "model.layers.1.mlp.up_proj.weight": torch.randn(6, 4, generator=generator),
        "model.norm.weight": torch.ones(4),
    }


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_single_safetensors(tmp_path: Path) -> None:
    tensors = _tiny_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _assert_same(dict(iter_safetensors(tmp_path)), tensors)


def test_sharded_safetensors(tmp_path: Path) -> None:
    tensors = _tiny_tensors()
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    _write_json(
        tmp_path / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map}
    )
    _assert_same(dict(iter_safetensors(tmp_path)), tensors)


def test_sharded_missing_shard_is_named(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    _write_json(
        tmp_path / "model.safetensors.index.json",
        {
            "weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors",
            }
        },
    )
    with pytest.raises(ModelConfigError, match="model-00002-of-00002.safetensors"):
        list(iter_safetensors(tmp_path))


def test_no_weights_raises(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelConfigError, match=r"No weights found.*\.bin/\.pt checkpoints"):
        list(iter_safetensors(tmp_path))


def test_corrupt_safetensors_raises(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelConfigError, match="Cannot read weights"):
        list(iter_safetensors(tmp_path))


# --------------------------------------------------------------------------- tokenizer


def _write_tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapper = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )
    wrapper.save_pretrained(str(folder))


def test_load_tokenizer_local(tmp_path: Path) -> None:
    _write_tiny_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer("hello world")["input_ids"] == [2, 3]
    assert tokenizer.eos_token_id == 1


def test_load_tokenizer_missing_files(tmp_path: Path) -> None:
    _write_json(tmp_path / "config.json", {"model_type": "llama"})
    with pytest.raises(ModelConfigError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
