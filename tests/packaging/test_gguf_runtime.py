"""The GGUF import needs only runtime dependencies (issue #18): its tensor renaming and the
undoing of llama.cpp's rotary row order, checked without the real model (fast)."""

from __future__ import annotations

import numpy as np
import pytest

from models.gguf_import import ModelImportError, hf_tensor_name, unpermute_rows


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, halves [a | b] -> a0 b0 a1 b1 ..."""
    out = np.empty_like(weight)
    head_dim = weight.shape[0] // n_heads
    half = head_dim // 2
    for h in range(n_heads):
        for i in range(half):
            for j in range(2):
                out[h * head_dim + 2 * i + j] = weight[h * head_dim + j * half + i]
    return out


@pytest.mark.parametrize("n_heads,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 8, 5)])
def test_unpermute_undoes_llama_cpp_row_order(n_heads: int, head_dim: int, cols: int) -> None:
    weight = np.random.default_rng(0).standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rows(permuted, n_heads), weight)


def test_tensor_names_map_to_hugging_face_llama() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert hf_tensor_name("blk.29.ffn_norm.weight") == (
        "model.layers.29.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.3.attn_k.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"


@pytest.mark.parametrize("name", ["blk.x.attn_q.weight", "blk.0.attn_q.bias", "rope_freqs.weight"])
def test_unknown_tensor_names_are_refused(name: str) -> None:
    with pytest.raises(ModelImportError, match="does not have"):
        hf_tensor_name(name)


def test_import_does_not_build_a_transformers_model() -> None:
    """``from_pretrained`` of a model on a GGUF requires accelerate; the importer must not."""
    import inspect

    from models import gguf_import

    source = inspect.getsource(gguf_import)
    assert "AutoModel" not in source and "import accelerate" not in source
