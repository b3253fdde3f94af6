"""Contract 2.1: the KV layout is resolved once, shared by every config copy, read by everyone."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from attention.layout import (
    LAYOUT_ENV,
    LayoutCell,
    LayoutError,
    LayoutNotResolvedError,
    choose_layout,
    parse_layout,
)
from engine.config import CacheConfig

NOT_RESOLVED = "KV cache layout has not been resolved yet"


# --------------------------------------------------------------------------- the shared cell


def test_replace_shares_cell_but_not_cache_dtype() -> None:
    base = CacheConfig(cache_dtype="auto")
    draft = dataclasses.replace(base, cache_dtype="bfloat16")
    assert draft.layout_cell is base.layout_cell
    assert (base.cache_dtype, draft.cache_dtype) == ("auto", "bfloat16")

    draft.layout_cell.set("HND")  # resolved through the copy ...
    assert base.layout == "HND"  # ... is visible through the original
    assert draft.layout == "HND"
    assert base.cache_dtype == "auto"  # dtype stays independent


def test_deepcopy_and_copy_share_cell() -> None:
    base = CacheConfig(cache_dtype="fp8")
    deep = copy.deepcopy(base)
    shallow = copy.copy(base)
    assert deep.layout_cell is base.layout_cell
    assert shallow.layout_cell is base.layout_cell
    # a deep copy of a structure holding the config shares the cell as well
    holder = copy.deepcopy({"cfg": base})
    assert holder["cfg"].layout_cell is base.layout_cell

    base.layout_cell.set("NHD")
    assert deep.layout == shallow.layout == holder["cfg"].layout == "NHD"


def test_cache_dtype_independent_across_replace_chain() -> None:
    base = CacheConfig(cache_dtype="fp8_e4m3")
    a = dataclasses.replace(base, cache_dtype="bfloat16")
    b = dataclasses.replace(copy.deepcopy(a), cache_dtype="float16")
    assert [c.cache_dtype for c in (base, a, b)] == ["fp8_e4m3", "bfloat16", "float16"]
    assert base.layout_cell is a.layout_cell is b.layout_cell


def test_separate_configs_have_separate_cells() -> None:
    one, two = CacheConfig(), CacheConfig()
    assert one.layout_cell is not two.layout_cell
    one.layout_cell.set("HND")
    with pytest.raises(LayoutNotResolvedError):
        _ = two.layout


def test_no_settable_layout_on_config() -> None:
    cfg = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layout = "NHD"  # type: ignore[misc]
    with pytest.raises(TypeError):
        dataclasses.replace(cfg, layout="NHD")  # not an init field


# --------------------------------------------------------------------------- write-once


def test_read_before_resolution_raises() -> None:
    cfg = CacheConfig()
    with pytest.raises(RuntimeError, match=NOT_RESOLVED):
        _ = cfg.layout
    copy_ = dataclasses.replace(cfg, cache_dtype="bfloat16")
    with pytest.raises(RuntimeError, match=NOT_RESOLVED):
        _ = copy_.layout
    assert not cfg.layout_cell.is_resolved


def test_second_resolution_to_other_value_raises() -> None:
    cell = LayoutCell()
    assert cell.set("NHD") == "NHD"
    with pytest.raises(LayoutError, match="already resolved to NHD"):
        cell.set("HND")
    assert cell.get() == "NHD"  # unchanged by the failed attempt
    # an alias of the other layout is still a different layout
    with pytest.raises(LayoutError):
        cell.set("LBHNC")


def test_second_resolution_through_a_copy_raises() -> None:
    base = CacheConfig()
    draft = dataclasses.replace(base, cache_dtype="bfloat16")
    base.layout_cell.set("HND")
    with pytest.raises(LayoutError):
        draft.layout_cell.set("NHD")
    assert base.layout == draft.layout == "HND"


@pytest.mark.parametrize("again", ["HND", "hnd", "LBHNC", " HND "])
def test_same_value_is_noop(again: str) -> None:
    cell = LayoutCell()
    cell.set("HND")
    assert cell.set(again) == "HND"
    assert cell.get() == "HND"


def test_resolving_to_unknown_name_raises_and_leaves_cell_unresolved() -> None:
    cell = LayoutCell()
    with pytest.raises(LayoutError, match="Unknown KV cache layout"):
        cell.set("XYZ")
    assert not cell.is_resolved


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "name, expected",
    [("NHD", "NHD"), ("HND", "HND"), ("nhd", "NHD"), ("LBNHC", "NHD"), ("LBHNC", "HND"),
     ("lbhnc", "HND")],
)
def test_parse_layout_aliases(name: str, expected: str) -> None:
    assert parse_layout(name) == expected


@pytest.mark.parametrize("name", ["XYZ", "", "NDH", "BNHD"])
def test_parse_layout_unknown(name: str) -> None:
    with pytest.raises(LayoutError) as info:
        parse_layout(name)
    msg = str(info.value)
    assert "Unknown KV cache layout" in msg
    for valid in ("NHD", "HND", "LBNHC", "LBHNC"):
        assert valid in msg


def test_cache_config_rejects_unknown_layout_request() -> None:
    with pytest.raises(ValueError, match="Unknown KV cache layout"):
        CacheConfig(layout_request="XYZ")


# --------------------------------------------------------------------------- choose_layout


BOTH = {"torch": ("NHD", "HND")}


def test_choose_explicit_request_wins() -> None:
    layout, reason = choose_layout("HND", BOTH, env={})
    assert layout == "HND"
    assert "--kv-cache-layout" in reason


def test_choose_explicit_request_beats_env() -> None:
    layout, _ = choose_layout("NHD", {"a": ("HND", "NHD")}, env={LAYOUT_ENV: "HND"})
    assert layout == "NHD"


def test_choose_env_when_no_request() -> None:
    layout, reason = choose_layout(None, BOTH, env={LAYOUT_ENV: "HND"})
    assert layout == "HND"
    assert LAYOUT_ENV in reason


def test_choose_env_alias_accepted() -> None:
    assert choose_layout(None, BOTH, env={LAYOUT_ENV: "LBHNC"})[0] == "HND"
    assert choose_layout("LBNHC", {"a": ("HND", "NHD")}, env={})[0] == "NHD"


def test_choose_env_unknown_name() -> None:
    with pytest.raises(LayoutError, match="Unknown KV cache layout 'XYZ'"):
        choose_layout(None, BOTH, env={LAYOUT_ENV: "XYZ"})


def test_choose_env_argument_overrides_process_env(monkeypatch) -> None:
    monkeypatch.setenv(LAYOUT_ENV, "HND")
    # an explicit (empty) env mapping means the process environment is not consulted
    assert choose_layout(None, {"a": ("NHD", "HND")}, env={})[0] == "NHD"
    # and with env=None the process environment is used
    assert choose_layout(None, {"a": ("NHD", "HND")})[0] == "HND"


def test_choose_backend_intersection_in_first_backend_order() -> None:
    layouts = {"first": ("HND", "NHD"), "second": ("NHD", "HND")}
    layout, reason = choose_layout(None, layouts, env={})
    assert layout == "HND"
    assert "backend" in reason
    assert choose_layout(None, {"a": ("NHD", "HND"), "b": ("HND",)}, env={})[0] == "HND"
    assert choose_layout(None, {"a": ("HND", "NHD"), "b": ("NHD",)}, env={})[0] == "NHD"


def test_choose_default_nhd_without_backends() -> None:
    assert choose_layout(None, {}, env={})[0] == "NHD"


def test_choose_no_common_layout() -> None:
    with pytest.raises(LayoutError, match="No KV cache layout is supported by every backend"):
        choose_layout(None, {"a": ("NHD",), "b": ("HND",)}, env={})


@pytest.mark.parametrize("requested, env", [("HND", {}), (None, {LAYOUT_ENV: "HND"})])
def test_choose_unsupported_request(requested, env) -> None:
    with pytest.raises(LayoutError) as info:
        choose_layout(requested, {"torch": ("NHD", "HND"), "fancy": ("NHD",)}, env=env)
    msg = str(info.value)
    assert "HND" in msg and "'fancy'" in msg and "not supported" in msg
    assert ("--kv-cache-layout" if requested else LAYOUT_ENV) in msg


def test_choose_unknown_request() -> None:
    with pytest.raises(LayoutError, match="Unknown KV cache layout 'ABC'"):
        choose_layout("ABC", BOTH, env={})
