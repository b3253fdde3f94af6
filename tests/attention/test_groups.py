"""Contract 2.2: every attention layer is in exactly one group; a group has one KV spec."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.dtypes import CacheDtypeError
from attention.groups import GroupValidationError, LayerKVSpec, build_groups
from engine.config import CacheConfig


def spec(name: str, group: str, dtype: str = "auto", heads: int = 2, head_size: int = 16,
         block_size: int = 16) -> LayerKVSpec:
    return LayerKVSpec(name, group, heads, head_size, dtype, block_size)


def target_and_draft(target_dtype: str, draft_dtype: str) -> list[LayerKVSpec]:
    return [spec(f"t{i}", "target", target_dtype) for i in range(3)] + [
        spec(f"d{i}", "draft", draft_dtype, heads=4, head_size=8) for i in range(2)
    ]


def test_groups_resolve_in_first_seen_order() -> None:
    groups = build_groups(target_and_draft("auto", "bfloat16"), torch.float32)
    assert list(groups) == ["target", "draft"]
    t, d = groups["target"], groups["draft"]
    assert t.layers == ("t0", "t1", "t2") and d.layers == ("d0", "d1")
    assert (t.dtype, d.dtype) == (torch.float32, torch.bfloat16)  # auto -> model dtype
    assert (t.num_kv_heads, t.head_size, d.num_kv_heads, d.head_size) == (2, 16, 4, 8)
    assert t.block_size == d.block_size == 16


@pytest.mark.parametrize(
    "target, draft, t_dtype, d_dtype",
    [
        ("fp8_e4m3", "bfloat16", torch.float8_e4m3fn, torch.bfloat16),
        ("bfloat16", "fp8", torch.bfloat16, torch.float8_e4m3fn),
        ("fp8_e5m2", "float16", torch.float8_e5m2, torch.float16),
        ("auto", "fp8_e5m2", torch.bfloat16, torch.float8_e5m2),
    ],
)
def test_each_group_keeps_its_dtype(target, draft, t_dtype, d_dtype) -> None:
    groups = build_groups(target_and_draft(target, draft), torch.bfloat16)
    assert groups["target"].dtype == t_dtype
    assert groups["draft"].dtype == d_dtype


def test_draft_dtype_from_replaced_config_target_from_base() -> None:
    """Layer specs built from the configs each model was built with (2.2)."""
    base = CacheConfig(cache_dtype="fp8")
    draft_cfg = dataclasses.replace(base, cache_dtype="bfloat16")
    specs = [spec("t0", "target", base.cache_dtype), spec("d0", "draft", draft_cfg.cache_dtype)]
    groups = build_groups(specs, torch.float32)
    assert groups["target"].dtype == torch.float8_e4m3fn
    assert groups["draft"].dtype == torch.bfloat16


def test_mixed_dtypes_in_one_group_fail_naming_group_layers_dtypes() -> None:
    specs = [spec("t0", "target"), spec("d0", "draft", "fp8_e4m3"),
             spec("d1", "draft", "bfloat16")]
    with pytest.raises(GroupValidationError) as info:
        build_groups(specs, torch.float32)
    msg = str(info.value)
    assert "'draft'" in msg
    assert "d0" in msg and "d1" in msg
    assert "float8_e4m3fn" in msg and "bfloat16" in msg
    assert "'target'" not in msg and "t0" not in msg


def test_auto_and_explicit_model_dtype_mix_is_fine() -> None:
    # "auto" resolves to the model dtype, so it agrees with the explicit name
    groups = build_groups([spec("t0", "target", "auto"), spec("t1", "target", "bfloat16")],
                          torch.bfloat16)
    assert groups["target"].dtype == torch.bfloat16
    with pytest.raises(GroupValidationError, match="mixes KV cache dtypes"):
        build_groups([spec("t0", "target", "auto"), spec("t1", "target", "bfloat16")],
                     torch.float32)


def test_fp8_and_fp8_e4m3_agree() -> None:
    groups = build_groups([spec("d0", "draft", "fp8"), spec("d1", "draft", "fp8_e4m3")],
                          torch.float32)
    assert groups["draft"].dtype == torch.float8_e4m3fn


def test_fp8_e4m3_and_e5m2_disagree() -> None:
    with pytest.raises(GroupValidationError, match="float8_e5m2"):
        build_groups([spec("d0", "draft", "fp8"), spec("d1", "draft", "fp8_e5m2")],
                     torch.float32)


@pytest.mark.parametrize(
    "field, bad, text",
    [("heads", 4, "num_kv_heads"), ("head_size", 32, "head_size"),
     ("block_size", 32, "block_size")],
)
def test_inconsistent_spec_within_group(field, bad, text) -> None:
    specs = [spec("t0", "target"), spec("t1", "target", **{field: bad}), spec("t2", "target")]
    with pytest.raises(GroupValidationError) as info:
        build_groups(specs, torch.float32)
    msg = str(info.value)
    assert "'target'" in msg and "inconsistent" in msg and text in msg
    assert "t1" in msg and str(bad) in msg


def test_different_block_sizes_across_groups_fail() -> None:
    specs = [spec("t0", "target", block_size=16), spec("d0", "draft", block_size=32)]
    with pytest.raises(GroupValidationError) as info:
        build_groups(specs, torch.float32)
    msg = str(info.value)
    assert "block_size" in msg and "target=16" in msg and "draft=32" in msg


def test_layer_in_two_groups_fails() -> None:
    specs = [spec("shared", "target"), spec("d0", "draft"), spec("shared", "draft")]
    with pytest.raises(GroupValidationError) as info:
        build_groups(specs, torch.float32)
    msg = str(info.value)
    assert "'shared'" in msg and "'target'" in msg and "'draft'" in msg


def test_layer_in_no_group_fails() -> None:
    with pytest.raises(GroupValidationError, match="not assigned to any attention group"):
        build_groups([spec("t0", "target"), spec("orphan", "")], torch.float32)


def test_unknown_cache_dtype_fails() -> None:
    with pytest.raises(CacheDtypeError, match="fp7"):
        build_groups([spec("t0", "target", "fp7")], torch.float32)


@pytest.mark.parametrize(
    "dtype, itemsize", [("float32", 4), ("bfloat16", 2), ("float16", 2), ("fp8", 1),
                        ("fp8_e5m2", 1)],
)
def test_bytes_per_block_per_layer(dtype, itemsize) -> None:
    g = build_groups([spec("t0", "target", dtype, heads=3, head_size=8, block_size=4)],
                     torch.float32)["target"]
    assert g.bytes_per_block_per_layer == 2 * 4 * 3 * 8 * itemsize
