"""Shared fixtures: tiny random Hugging Face model folders (session-scoped, built once)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY_VOCAB = 256
TINY_EOS = 2
TINY_MAX_POSITIONS = 256


def _tiny_common() -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=TINY_MAX_POSITIONS,
        rms_norm_eps=1e-6,
        # A wide initializer keeps greedy continuations from collapsing into one repeated
        # token, so token-for-token comparisons actually exercise the attention state.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(**_tiny_common(), rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    return _save(model, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4321)
    cfg = Qwen3Config(**_tiny_common(), head_dim=16, rope_theta=1000000.0)
    model = Qwen3ForCausalLM(cfg).eval()
    return _save(model, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_model_dir(request) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture
def one_torch_thread():
    """Run a test with one intra-op thread. The tiny tensors of these tests gain nothing from
    more threads, and on a loaded 2-core machine OpenMP hand-offs cost ~10 ms per op (measured:
    a 1x4x32x16 SDPA takes 15 ms with 2 threads under load, 4 us with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
