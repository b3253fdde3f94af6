"""Fixtures for the speculative-decoding tests (tiny random models, built once per session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from .helpers import TARGET_VOCAB, greedy, make_llm, save_draft, save_target, token_ids


@pytest.fixture(scope="package", autouse=True)
def _single_thread():
    """These models are tiny; on a shared 2-core machine, two intra-op threads that contend
    with other processes are an order of magnitude slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("spec-qwen3-target"), "qwen3", seed=11)


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("spec-llama-target"), "llama", seed=12, tie=True)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory) -> Path:
    """Random draft for the tiny targets: 2 layers, 1 KV head of 32 (the target has 2 of 16),
    block size 4, taps [1, 2], mask id 255."""
    folder = tmp_path_factory.mktemp("spec-draft")
    save_draft(folder, seed=21)
    return folder


@pytest.fixture(scope="session")
def draft_b8_dir(tmp_path_factory) -> Path:
    """Random draft with block size 8 and three taps including layer 0 and the last layer."""
    folder = tmp_path_factory.mktemp("spec-draft-b8")
    save_draft(folder, seed=22, block_size=8, target_layer_ids=(0, 2, 3), layers=1)
    return folder


@pytest.fixture(scope="session")
def baseline_cache():
    """Greedy no-spec outputs, memoised by (model, target cache dtype, prompts, max_tokens)."""
    cache: dict = {}

    def get(model, prompts, max_tokens, cache_dtype="auto"):
        key = (str(model), cache_dtype, tuple(map(tuple, prompts)), tuple(max_tokens))
        if key not in cache:
            llm = make_llm(model, None, kv_cache_dtype=cache_dtype)
            outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
            cache[key] = token_ids(outs)
        return cache[key]

    return get


__all__ = ["TARGET_VOCAB"]
