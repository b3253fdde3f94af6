"""Bad speculative configuration fails at startup with a typed error naming the field and the
allowed values."""

from __future__ import annotations

import json

import pytest

from attention.dtypes import CACHE_DTYPES
from engine.config import ConfigError, SpeculativeConfig

from .helpers import edit_json, make_llm, save_draft


def _draft(tmp_path, **kw):
    save_draft(tmp_path, seed=2, **kw)
    return str(tmp_path)


def _start(target, spec, **kw):
    return make_llm(target, spec, **kw)


def test_draft_hidden_size_differs(qwen3_target, tmp_path):
    d = _draft(tmp_path, hidden=32)
    with pytest.raises(ConfigError) as err:
        _start(qwen3_target, {"method": "dflash", "model": d})
    msg = str(err.value)
    assert "hidden_size" in msg and "32" in msg and "64" in msg
    assert err.value.param == "speculative_config.model"


@pytest.mark.parametrize("ids", [[1, 4], [-1, 2], []])
def test_target_layer_ids_out_of_range(qwen3_target, tmp_path, ids):
    d = _draft(tmp_path)
    edit_json(tmp_path / "config.json", dflash_config={"target_layer_ids": ids, "mask_token_id": 255})
    with pytest.raises(ConfigError) as err:
        _start(qwen3_target, {"method": "dflash", "model": d})
    msg = str(err.value)
    assert "target_layer_ids" in msg and "[0, 3]" in msg
    assert err.value.param == "speculative_config.model"


@pytest.mark.parametrize("mask_id", [256, -1, 100000])
def test_mask_token_outside_vocab(qwen3_target, tmp_path, mask_id):
    d = _draft(tmp_path, mask_token_id=mask_id)
    with pytest.raises(ConfigError) as err:
        _start(qwen3_target, {"method": "dflash", "model": d})
    msg = str(err.value)
    assert "mask_token_id" in msg and "[0, 255]" in msg and str(mask_id) in msg


def test_missing_mask_token_without_mask_embedding(qwen3_target, tmp_path):
    d = _draft(tmp_path, mask_token_id=None)
    with pytest.raises(ConfigError, match="mask_token_id"):
        _start(qwen3_target, {"method": "dflash", "model": d})


def test_mask_embedding_of_wrong_shape(qwen3_target, tmp_path):
    import torch

    d = _draft(tmp_path, mask_token_id=None, mask_embedding=torch.zeros(32))
    with pytest.raises(ValueError, match="mask_embedding"):
        _start(qwen3_target, {"method": "dflash", "model": d})


@pytest.mark.parametrize("k", [0, -2])
def test_num_speculative_tokens_below_one(qwen3_target, draft_dir, k):
    spec = {"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": k}
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse(spec)
    assert err.value.param == "speculative_config.num_speculative_tokens"
    assert ">= 1" in str(err.value)
    with pytest.raises(ConfigError):
        _start(qwen3_target, spec)
    with pytest.raises(ConfigError):
        SpeculativeConfig.parse(json.dumps(spec))


@pytest.mark.parametrize("k", [4, 16])
def test_num_speculative_tokens_not_below_block_size(qwen3_target, draft_dir, k):
    """The draft has block size 4: at most 3 drafts per block."""
    with pytest.raises(ConfigError) as err:
        _start(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                              "num_speculative_tokens": k})
    assert err.value.param == "speculative_config.num_speculative_tokens"
    assert "[1, 3]" in str(err.value) and str(k) in str(err.value)


def test_non_integer_num_speculative_tokens(draft_dir):
    with pytest.raises(ConfigError):
        SpeculativeConfig.parse({"method": "dflash", "model": str(draft_dir),
                                 "num_speculative_tokens": "3"})


@pytest.mark.parametrize("method", ["foo", "eagle3", ""])
def test_unknown_method(qwen3_target, method):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse({"method": method})
    assert err.value.param == "speculative_config.method"
    assert "dflash" in str(err.value) and "ngram" in str(err.value)
    with pytest.raises(ConfigError, match="method"):
        _start(qwen3_target, {"method": method})


def test_unknown_draft_cache_dtype_names_the_field(qwen3_target, draft_dir):
    """kv_cache_dtype 'fp7' in the speculative config: the error must say that it is the
    *speculative* config's kv_cache_dtype (the base one is fine) and list the valid values."""
    spec = {"method": "dflash", "model": str(draft_dir), "kv_cache_dtype": "fp7"}
    for attempt in (lambda: SpeculativeConfig.parse(spec), lambda: _start(qwen3_target, spec)):
        with pytest.raises(ValueError) as err:
            attempt()
        msg = str(err.value)
        assert "fp7" in msg and all(name in msg for name in CACHE_DTYPES)
        named = getattr(err.value, "param", None) == "speculative_config.kv_cache_dtype" or \
            "speculative_config.kv_cache_dtype" in msg
        assert named, f"the error does not name speculative_config.kv_cache_dtype: {msg!r}"


def test_unknown_base_cache_dtype(qwen3_target, draft_dir):
    with pytest.raises(ValueError) as err:
        _start(qwen3_target, {"method": "dflash", "model": str(draft_dir)}, kv_cache_dtype="fp7")
    assert "fp7" in str(err.value) and "bfloat16" in str(err.value)


@pytest.mark.parametrize("text", ['{"method": "dflash",', "{method: dflash}", "[1, 2"])
def test_malformed_json(qwen3_target, text):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse(text)
    assert err.value.param == "speculative_config"
    assert "JSON" in str(err.value)
    with pytest.raises(ConfigError, match="JSON"):
        _start(qwen3_target, text)


def test_json_that_is_not_an_object():
    with pytest.raises(ConfigError, match="object"):
        SpeculativeConfig.parse("[1, 2]")


def test_unknown_keys_listed(draft_dir):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse({"method": "dflash", "model": str(draft_dir), "num_tokens": 3})
    assert "num_tokens" in str(err.value) and "num_speculative_tokens" in str(err.value)


def test_dflash_needs_a_draft_folder(qwen3_target, tmp_path):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse({"method": "dflash"})
    assert err.value.param == "speculative_config.model"
    with pytest.raises(ConfigError) as err:
        _start(qwen3_target, {"method": "dflash", "model": str(tmp_path / "missing")})
    assert err.value.param == "speculative_config.model"


def test_draft_folder_that_is_not_a_dflash_draft(qwen3_target):
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        _start(qwen3_target, {"method": "dflash", "model": str(qwen3_target)})


def test_ngram_lookup_bounds(qwen3_target):
    with pytest.raises(ValueError) as err:
        _start(qwen3_target, {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    assert "prompt_lookup_min" in str(err.value) and "prompt_lookup_max" in str(err.value)


def test_valid_spellings_parse(draft_dir):
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("none") is None
    cfg = SpeculativeConfig.parse(json.dumps({"method": "DFlash", "model": str(draft_dir),
                                              "num_speculative_tokens": 2,
                                              "kv_cache_dtype": "fp8"}))
    assert (cfg.method, cfg.num_speculative_tokens, cfg.kv_cache_dtype) == ("dflash", 2, "fp8")


def test_draft_dtype_checked_against_backend_per_group(qwen3_target, draft_dir, monkeypatch):
    """Each group's resolved cache dtype is checked by that group's backend at startup; a
    backend that cannot serve the draft's dtype stops startup with an error naming the group."""
    import torch

    from attention.backends.torch_backend import TorchBackend

    calls = []
    original = TorchBackend.check_support

    def picky(self, kv_dtype, q_dtype, head_size, group):
        calls.append((group, kv_dtype, head_size))
        if kv_dtype == torch.float8_e5m2:
            raise ValueError(f"Backend 'torch' does not support KV dtype float8_e5m2 for group {group!r}")
        return original(self, kv_dtype, q_dtype, head_size, group)

    monkeypatch.setattr(TorchBackend, "check_support", picky)
    _start(qwen3_target, {"method": "dflash", "model": str(draft_dir), "kv_cache_dtype": "fp8"},
           kv_cache_dtype="bfloat16")
    assert ("target", torch.bfloat16, 16) in calls and ("draft", torch.float8_e4m3fn, 32) in calls
    with pytest.raises(ValueError, match="'draft'"):
        _start(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                              "kv_cache_dtype": "fp8_e5m2"})


def test_draft_heads_not_divisible_by_kv_heads_rejected_at_startup(qwen3_target, tmp_path):
    """A draft with 4 query heads over 3 KV heads cannot run grouped-query attention. The
    target's loader rejects such a config at startup; the draft's must too, instead of
    starting and then failing inside the first engine step."""
    from .helpers import greedy

    d = _draft(tmp_path, heads=4, kv_heads=3, head_dim=16)
    try:
        llm = _start(qwen3_target, {"method": "dflash", "model": d})
    except ValueError as exc:
        assert "num_key_value_heads" in str(exc) or "num_attention_heads" in str(exc)
        return
    with pytest.raises(Exception) as err:  # what the first request hits today
        llm.generate([[5, 6, 7]], greedy(4))
    pytest.fail(f"draft accepted at startup; the first step then fails with "
                f"{type(err.value).__name__}: {str(err.value)[:120]}")
