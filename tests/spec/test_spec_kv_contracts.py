"""Per-group cache dtype and one resolved layout under speculation (DESIGN 2.1-2.3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.layout import LayoutError

from .helpers import greedy, make_llm, random_prompts

DTYPES = {"auto": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
          "float16": torch.float16, "fp8_e5m2": torch.float8_e5m2}
TARGET_KV = (2, 16)  # kv heads, head dim of the tiny target
DRAFT_KV = (1, 32)  # of the tiny draft


def _spec(draft, dtype=None):
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    if dtype is not None:
        spec["kv_cache_dtype"] = dtype
    return spec


@pytest.mark.parametrize("target_dtype,draft_dtype", [
    ("auto", None), ("fp8", "bfloat16"), ("bfloat16", "fp8"), ("fp8", None),
    ("float16", "fp8_e5m2"),
])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_group_dtypes_and_layout(qwen3_target, draft_dir, target_dtype, draft_dtype, layout):
    llm = make_llm(qwen3_target, _spec(draft_dir, draft_dtype), kv_cache_dtype=target_dtype,
                   kv_cache_layout=layout)
    engine = llm.engine
    want_target = DTYPES[target_dtype]
    want_draft = DTYPES[draft_dtype] if draft_dtype else want_target  # else the base dtype
    pool = engine.pool
    nb, bs = pool.num_blocks, engine.config.cache.block_size
    for i in range(4):
        kv = pool.layer(f"target.layers.{i}")
        assert kv.physical.dtype == want_target and kv.dtype == want_target
        h, d = TARGET_KV
        assert tuple(kv.physical.shape) == ((nb, 2, bs, h, d) if layout == "NHD" else (nb, 2, h, bs, d))
        assert tuple(kv.logical.shape) == (nb, 2, bs, h, d)
        assert kv.layout == layout
    for i in range(2):
        kv = pool.layer(f"draft.layers.{i}")
        assert kv.physical.dtype == want_draft, (kv.name, kv.physical.dtype)
        h, d = DRAFT_KV
        assert tuple(kv.physical.shape) == ((nb, 2, bs, h, d) if layout == "NHD" else (nb, 2, h, bs, d))
        assert kv.layout == layout == pool.layout
    # the layout is resolved once and shared by every copy of the cache config
    cache = engine.config.cache
    assert cache.layout == layout
    draft_cache = dataclasses.replace(cache, cache_dtype=draft_dtype or "auto")
    assert draft_cache.layout == layout and draft_cache.layout_cell is cache.layout_cell
    assert cache.cache_dtype == target_dtype  # the base dtype is untouched by the draft's
    # the proposer's handles are the pool's draft layers
    proposer = engine.runner.proposer
    handles = getattr(proposer, "_kv", None)
    if handles is not None:
        assert [kv.name for kv in handles] == ["draft.layers.0", "draft.layers.1"]
        assert all(kv.layout == layout and kv.physical.dtype == want_draft for kv in handles)
        assert all(a.physical is pool.layer(a.name).physical for a in handles)
    # the target's own handles (runner) are the target group
    assert all(kv.group.name == "target" for kv in engine.runner.kv_layers)
    groups = engine.startup_info["groups"]
    assert groups == {"target": str(want_target).removeprefix("torch."),
                      "draft": str(want_draft).removeprefix("torch.")}


def test_draft_pages_written_in_draft_dtype_and_target_pages_untouched_by_draft(
        qwen3_target, draft_dir):
    """After a run, both groups hold data; the draft's K/V went to the draft's own tensors."""
    llm = make_llm(qwen3_target, _spec(draft_dir, "bfloat16"), kv_cache_dtype="fp8",
                   kv_cache_layout="HND")
    pool = llm.engine.pool
    llm.generate(random_prompts([9]), greedy(12))
    for name in ("target.layers.0", "draft.layers.0", "draft.layers.1"):
        pages = pool.layer(name).physical
        assert pages.float().abs().sum() > 0, f"{name} was never written"
    assert pool.layer("draft.layers.0").physical.dtype == torch.bfloat16
    ptrs = {pool.layer(n).physical.data_ptr() for n in
            [f"target.layers.{i}" for i in range(4)] + ["draft.layers.0", "draft.layers.1"]}
    assert len(ptrs) == 6  # no two layers share pages


def test_pool_budget_counts_both_groups(qwen3_target, draft_dir):
    """num_blocks = budget // bytes per block summed over target and draft layers."""
    budget = 3 << 20
    llm = make_llm(qwen3_target, _spec(draft_dir, "bfloat16"), kv_cache_dtype="fp8",
                   kv_cache_memory=budget)
    bs = llm.engine.config.cache.block_size
    per_block = 4 * 2 * bs * 2 * 16 * 1 + 2 * 2 * bs * 1 * 32 * 2  # target fp8 + draft bf16
    assert llm.engine.pool.num_blocks == budget // per_block


def test_lookahead_reserved_for_draft_block(qwen3_target, draft_dir):
    """A pool that fits max_model_len but not the draft's look-ahead block is refused."""
    from engine.kv_pool import KVBudgetError

    # max_model_len 64, block 16: 4 blocks hold the context; K=3 needs 4 more slots -> 5 blocks
    with pytest.raises(KVBudgetError, match="look-ahead"):
        make_llm(qwen3_target, _spec(draft_dir), max_model_len=64, num_kv_blocks=4,
                 block_size=16)
    make_llm(qwen3_target, _spec(draft_dir), max_model_len=64, num_kv_blocks=5, block_size=16)


def test_env_layout_applies_to_both_groups(qwen3_target, draft_dir, monkeypatch):
    monkeypatch.setenv("SPECSERVE_KV_CACHE_LAYOUT", "HND")
    llm = make_llm(qwen3_target, _spec(draft_dir))
    assert llm.engine.config.cache.layout == "HND"
    assert llm.engine.pool.layer("draft.layers.1").layout == "HND"
    assert llm.engine.pool.layer("target.layers.3").physical.shape[2] == TARGET_KV[0]


def test_bad_layout_rejected(qwen3_target, draft_dir):
    with pytest.raises(LayoutError, match="NHD"):
        make_llm(qwen3_target, _spec(draft_dir), kv_cache_layout="NCHW")
