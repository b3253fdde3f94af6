"""Contract 2.3: one shared paged KV pool, sized by bytes per block, one page tensor per layer."""

from __future__ import annotations

import pytest
import torch

from attention.groups import GroupSpec, LayerKVSpec, build_groups
from attention.kv import gather_kv, write_kv
from attention.layout import LAYOUT_ENV
from engine.kv_pool import KVBudgetError, KVPool, plan_pool

CPU = torch.device("cpu")
ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2,
            torch.float8_e4m3fn: 1, torch.float8_e5m2: 1}


def make_groups(target_dtype: str, draft_dtype: str, block_size: int = 16,
                model_dtype: torch.dtype = torch.float32) -> list[GroupSpec]:
    specs = [LayerKVSpec(f"target.layers.{i}", "target", 2, 16, target_dtype, block_size)
             for i in range(3)]
    specs += [LayerKVSpec(f"draft.layers.{i}", "draft", 4, 8, draft_dtype, block_size)
              for i in range(2)]
    return list(build_groups(specs, model_dtype).values())


def expected_bytes_per_block(groups: list[GroupSpec]) -> int:
    return sum(2 * g.block_size * g.num_kv_heads * g.head_size * ITEMSIZE[g.dtype]
               for g in groups for _ in g.layers)


# --------------------------------------------------------------------------- sizing


@pytest.mark.parametrize("target, draft", [("fp8_e4m3", "bfloat16"), ("bfloat16", "fp8"),
                                           ("auto", "fp8_e5m2"), ("float16", "auto")])
def test_bytes_per_block_and_num_blocks(target: str, draft: str) -> None:
    groups = make_groups(target, draft)
    bpb = expected_bytes_per_block(groups)
    # hand-computed for one case to pin the formula itself
    if (target, draft) == ("fp8_e4m3", "bfloat16"):
        assert bpb == 3 * (2 * 16 * 2 * 16 * 1) + 2 * (2 * 16 * 4 * 8 * 2)
    budget = 37 * bpb + bpb - 1  # just short of 38 blocks
    plan = plan_pool(groups, budget, max_model_len=64, lookahead=0)
    assert plan.bytes_per_block == bpb
    assert plan.num_blocks == budget // bpb == 37


def test_allocated_pages_match_plan() -> None:
    groups = make_groups("fp8_e4m3", "bfloat16")
    plan = plan_pool(groups, 1 << 20, max_model_len=128, lookahead=4)
    pool = KVPool(groups, plan.num_blocks, "NHD", CPU)
    total = sum(pool.layer(n).physical.numel() * pool.layer(n).physical.element_size()
                for g in groups for n in g.layers)
    assert total == plan.num_blocks * plan.bytes_per_block
    assert pool.num_blocks == plan.num_blocks


def test_num_blocks_override() -> None:
    groups = make_groups("auto", "auto")
    plan = plan_pool(groups, 10**9, max_model_len=32, lookahead=0, num_blocks_override=5)
    assert plan.num_blocks == 5


def test_budget_too_small_raises_with_what_to_change() -> None:
    groups = make_groups("bfloat16", "bfloat16", block_size=16)
    bpb = expected_bytes_per_block(groups)
    # max_model_len 100 + 9 look-ahead tokens = 109 tokens -> 7 blocks of 16
    ok = plan_pool(groups, 7 * bpb, max_model_len=100, lookahead=9)
    assert ok.num_blocks == 7
    with pytest.raises(KVBudgetError) as info:
        plan_pool(groups, 7 * bpb - 1, max_model_len=100, lookahead=9)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "max_model_len=100" in msg and "7 blocks" in msg
    assert "max-model-len" in msg and "kv-cache-memory" in msg  # what to change
    assert "6 blocks" in msg  # what the budget holds


def test_lookahead_counts_toward_the_minimum() -> None:
    groups = make_groups("auto", "auto", block_size=16)
    bpb = expected_bytes_per_block(groups)
    plan_pool(groups, 4 * bpb, max_model_len=64, lookahead=0)
    with pytest.raises(KVBudgetError):
        plan_pool(groups, 4 * bpb, max_model_len=64, lookahead=1)


def test_override_too_small_raises() -> None:
    groups = make_groups("auto", "auto", block_size=16)
    with pytest.raises(KVBudgetError):
        plan_pool(groups, 10**9, max_model_len=64, lookahead=0, num_blocks_override=3)


# --------------------------------------------------------------------------- isolation


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("target, draft", [("fp8_e4m3", "bfloat16"), ("bfloat16", "fp8_e4m3"),
                                           ("fp8_e5m2", "float16")])
def test_groups_never_overwrite_each_other(layout: str, target: str, draft: str) -> None:
    groups = make_groups(target, draft, block_size=4)
    pool = KVPool(groups, 6, layout, CPU)
    names = [n for g in groups for n in g.layers]

    # the pages are disjoint memory
    ranges = sorted(_byte_range(pool.layer(n).physical) for n in names)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start, "two layers' pages overlap"

    # write a distinct pattern through the same slots into every layer, then read all back
    slots = torch.tensor([1, 2, 3, 4, 9, 14, 23])  # spans blocks 0, 1, 2, 3, 5
    patterns = {}
    for i, name in enumerate(names):
        kv = pool.layer(name)
        h, d = kv.group.num_kv_heads, kv.group.head_size
        # +-2^i * (1, 1.25, 1.5 or 1.75) * 2^(j // 4): exact even in fp8 e5m2 (2-bit
        # mantissa), distinct per layer (exponent), group (sign) and slot
        sign = 1.0 if kv.group.name == "target" else -1.0
        j = torch.arange(len(slots), dtype=torch.float32)
        per_slot = (1 + (j % 4) / 4) * 2 ** torch.div(j, 4, rounding_mode="floor")
        k = (sign * 2.0**i * per_slot).view(-1, 1, 1).expand(-1, h, d).clone()
        v = -k / 2
        write_kv(kv, k, v, slots)
        patterns[name] = (k, v)
    for name in names:
        kv = pool.layer(name)
        k, v = patterns[name]
        bs = kv.block_size
        for j, slot in enumerate(slots.tolist()):
            got_k = kv.logical[slot // bs, 0, slot % bs].to(torch.float32)
            got_v = kv.logical[slot // bs, 1, slot % bs].to(torch.float32)
            assert torch.equal(got_k, k[j]), f"{name} K at slot {slot} was overwritten"
            assert torch.equal(got_v, v[j]), f"{name} V at slot {slot} was overwritten"
        # the same data through the reader used by attention
        table = torch.tensor([[0, 1, 2, 3, 4, 5]])
        gk, gv = gather_kv(kv, table, torch.float32)  # [1, H, 24, D]
        for j, slot in enumerate(slots.tolist()):
            assert torch.equal(gk[0, :, slot], k[j])
            assert torch.equal(gv[0, :, slot], v[j])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("target, draft", [("fp8_e4m3", "bfloat16"), ("bfloat16", "fp8_e4m3")])
def test_pages_stored_in_group_dtype_and_layout(layout: str, target: str, draft: str) -> None:
    groups = make_groups(target, draft, block_size=4)
    pool = KVPool(groups, 5, layout, CPU)
    assert pool.layout == layout
    by_name = {g.name: g for g in groups}
    for g in groups:
        for name in g.layers:
            kv = pool.layer(name)
            assert kv.group is by_name[g.name] or kv.group == by_name[g.name]
            assert kv.physical.dtype == g.dtype == kv.dtype
            assert kv.layout == layout
            h, d = g.num_kv_heads, g.head_size
            phys = (5, 2, 4, h, d) if layout == "NHD" else (5, 2, h, 4, d)
            assert tuple(kv.physical.shape) == phys
            assert kv.physical.is_contiguous()
            assert tuple(kv.logical.shape) == (5, 2, 4, h, d)
    assert pool.layer("target.layers.0").dtype != pool.layer("draft.layers.0").dtype
    # writing a value that is not representable in fp8 shows the rounding really happens
    for name in ("target.layers.0", "draft.layers.0"):
        kv = pool.layer(name)
        x = torch.full((1, kv.group.num_kv_heads, kv.group.head_size), 1.0 + 2**-6)
        write_kv(kv, x, x, torch.tensor([0]))
        stored = float(kv.logical[0, 0, 0, 0, 0].float())
        if kv.dtype == torch.float8_e4m3fn:
            assert stored == 1.0  # 3-bit mantissa
        else:
            assert stored == 1.0 + 2**-6  # bfloat16 keeps it
    assert len(pool.layers(["target.layers.1", "draft.layers.1"])) == 2


# --------------------------------------------------------------------------- the engine's pool


def _engine(model_dir, **kwargs):
    from engine.llm import LLM

    args = dict(model=str(model_dir), dtype="float32", speculative_config=None,
                max_model_len=64, kv_cache_memory="4MiB", block_size=16)
    args.update(kwargs)
    return LLM(**args).engine


def test_the_default_block_size_is_chosen_by_device(tiny_llama_dir) -> None:
    from engine.args import default_block_size
    from engine.llm import LLM

    assert default_block_size(torch.device("cpu")) == 128
    assert default_block_size(torch.device("cuda")) == 16
    engine = LLM(model=str(tiny_llama_dir), dtype="float32", speculative_config=None,
                 max_model_len=256, kv_cache_memory="4MiB").engine
    assert engine.config.cache.block_size == 128
    assert engine.runner.kv_layers[0].block_size == 128


@pytest.mark.parametrize("requested", [None, "HND", "NHD", "LBHNC"])
def test_engine_pool_uses_resolved_layout(tiny_llama_dir, monkeypatch, requested) -> None:
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    engine = _engine(tiny_llama_dir, kv_cache_layout=requested)
    expected = {None: "NHD", "HND": "HND", "NHD": "NHD", "LBHNC": "HND"}[requested]
    assert engine.config.cache.layout == expected
    assert engine.pool.layout == expected
    for name in engine.target_layers:
        assert engine.pool.layer(name).layout == expected
    kv = engine.runner.kv_layers[0]
    assert kv.layout == expected
    shape = tuple(kv.physical.shape)
    bs, h, d = 16, 2, 16
    assert shape[2:] == ((bs, h, d) if expected == "NHD" else (h, bs, d))


def test_engine_layout_from_env(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setenv(LAYOUT_ENV, "HND")
    engine = _engine(tiny_llama_dir)
    assert engine.pool.layout == engine.config.cache.layout == "HND"


def test_engine_pool_dtype_and_size(tiny_llama_dir) -> None:
    engine = _engine(tiny_llama_dir, kv_cache_dtype="fp8", kv_cache_memory="1MiB")
    layers = engine.pool.layers(engine.target_layers)
    assert all(kv.physical.dtype == torch.float8_e4m3fn for kv in layers)
    # 2 layers x 2 (K, V) x 16 tokens x 2 heads x 16 dims x 1 byte
    bpb = 2 * 2 * 16 * 2 * 16 * 1
    assert engine.pool.num_blocks == (1 << 20) // bpb == engine.blocks.num_blocks


def test_cpu_pool_pages_advised_huge_and_zeroed():
    """The CPU pool asks for transparent huge pages before touching its pages (the attention
    kernel reads K/V through fewer TLB entries) and still starts zeroed."""
    import sys
    from pathlib import Path

    import torch

    from engine.kv_pool import advise_huge_pages

    assert advise_huge_pages(torch.empty(1024)) is False  # under 2 MiB: nothing to advise
    big = torch.empty(8 << 20, dtype=torch.uint8)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform.startswith("linux") and thp.exists():  # a kernel built with THP
        assert advise_huge_pages(big) is True
    from attention.groups import LayerKVSpec, build_groups
    from engine.kv_pool import KVPool

    groups = build_groups([LayerKVSpec("l0", "target", 2, 64, "bfloat16", 128)], torch.bfloat16)
    pool = KVPool(list(groups.values()), 64, "NHD", torch.device("cpu"))
    pages = pool.layer("l0").physical
    assert pages.numel() * pages.element_size() >= 2 << 20 and not pages.any()
