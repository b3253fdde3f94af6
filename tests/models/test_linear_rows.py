"""``models.layers.linear``: a row's result does not depend on how many rows the product has.

On an AVX-512-BF16 CPU, oneDNN's one-row bf16 product rounds differently from the product of
two or more rows; with heavy-tailed activations like a real model's, about one row in seven
differs in the last bit (measured here with plain ``F.linear``). A token decoded alone and the
same token verified inside a block of drafts must get the same logits, so ``linear`` never
multiplies a single reduced-precision row on its own. The same holds for weights packed by
oneDNN (``pack_weight``), in bf16 and in fp32, where the packed product is also row-count
invariant (MKL's plain fp32 product is not). The direct oneDNN path (``models/onednn.py``) and,
for bf16 without it, the AVX2 panel kernel (``models/panel_linear.py``; each with its own tests)
are what ``pack_weight`` returns where they build; these tests hold for all of them.

With AMX, PyTorch's bf16 products (plain and packed) switch between AVX-512 and AMX kernels by
row count: 21 of 256 rows of a padded single row differed from the same row in the batch on a
Xeon with AMX. There the plain-weight bf16 tests skip; serving takes the direct path, which
holds every call to a row range measured invariant (``models/onednn.py``), tested here and in
test_onednn_linear.py on every machine."""

from __future__ import annotations

import pytest
import torch

from models.layers import (DIRECT_PAD_CHOICES, PAD_CHOICES, Linear, fastest_min_rows, linear,
                           pack_weight)


def _torch_bf16_or_skip(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        pytest.skip("with AMX, PyTorch's own bf16 products change kernels with the row count")


def _activations(dtype: torch.dtype, rows: int = 256, width: int = 1536) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(576, width, generator=g) * 0.02).to(dtype)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, width, generator=g).pow(4) * 8
    return x.to(dtype), w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_equals_the_row_in_a_batch(dtype):
    _torch_bf16_or_skip(dtype)
    x, w = _activations(dtype)
    full = linear(x, w)
    differing = [i for i in range(x.shape[0]) if not torch.equal(linear(x[i:i + 1], w)[0], full[i])]
    assert differing == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_batches_equal_the_rows_in_a_large_one(dtype):
    _torch_bf16_or_skip(dtype)
    x, w = _activations(dtype)
    full = linear(x, w)
    for m in (2, 3, 5, 8, 9, 16, 33):
        for start in (0, 7, 100):
            assert torch.equal(linear(x[start:start + m], w), full[start:start + m]), (m, start)


def test_linear_module_uses_the_row_stable_product():
    _torch_bf16_or_skip(torch.bfloat16)
    x, w = _activations(torch.bfloat16, rows=64)
    layer = Linear(w.shape[1], w.shape[0], bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.normal_()
        full = layer(x)
        for i in range(x.shape[0]):
            assert torch.equal(layer(x[i:i + 1])[0], full[i])
    assert layer(x[:1]).shape == (1, 576)


def _packed_or_skip(w: torch.Tensor) -> torch.Tensor:
    packed = pack_weight(w)
    if packed is None:
        pytest.skip(f"oneDNN cannot pack {w.dtype} weights on this CPU")
    return packed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_rows_do_not_depend_on_the_row_count(dtype):
    x, w = _activations(dtype, rows=80)
    packed = _packed_or_skip(w)
    full = linear(x, None, packed=packed)
    assert full.dtype == dtype and full.shape == (80, 576)
    torch.testing.assert_close(full.float(), linear(x, w).float(), rtol=2e-2, atol=2e-2)
    for m in (1, 2, 3, 5, 8, 9, 11, 16, 33):
        for start in (0, 7, 40):
            got = linear(x[start:start + m], None, packed=packed)
            assert torch.equal(got, full[start:start + m]), (m, start)


def test_packed_bf16_product_has_the_plain_products_bits(monkeypatch):
    """PyTorch's packing only saves oneDNN re-blocking the weight on each call: same kernel,
    same bits."""
    monkeypatch.setenv("SPECSERVE_ONEDNN", "0")
    monkeypatch.setenv("SPECSERVE_PANEL_LINEAR", "0")
    x, w = _activations(torch.bfloat16, rows=40)
    assert torch.equal(linear(x, None, packed=_packed_or_skip(w)), linear(x, w))


def test_pack_swaps_the_weight_for_good():
    x, w = _activations(torch.float32, rows=16)
    layer = Linear(w.shape[1], w.shape[0], bias=True)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.normal_()
        before = layer(x)
        layer.pack()
        if layer.packed is None:
            pytest.skip("oneDNN cannot pack float32 weights on this CPU")
        assert layer.weight is None and "weight" not in dict(layer.named_parameters())
        torch.testing.assert_close(layer(x), before, rtol=1e-4, atol=1e-4)
        assert torch.equal(layer(x[3:4])[0], layer(x)[3])


def test_nothing_is_packed_off_the_cpu_or_in_other_dtypes():
    assert pack_weight(torch.zeros(8, 8, dtype=torch.float64)) is None
    assert pack_weight(torch.zeros(8, 8, device="meta")) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loading_packs_the_projections_and_a_copy_of_the_head(tiny_llama_dir, dtype):
    import json

    from models.loader import load_target

    hf = json.loads((tiny_llama_dir / "config.json").read_text())
    model = load_target(tiny_llama_dir, hf, dtype, 64, torch.device("cpu"))
    if pack_weight(model.lm_head_weight) is None:
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    layer = model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert proj.packed is not None and proj.weight is None
        assert proj.min_rows == model.min_rows  # the padding pack_weights timed fastest
    assert model.min_rows in set(PAD_CHOICES) | set(DIRECT_PAD_CHOICES)
    assert model.head_packed is not None and model.lm_head_weight is not None  # drafts read it
    hidden = torch.randn(5, hf["hidden_size"]).to(dtype)
    torch.testing.assert_close(model.compute_logits(hidden).float(),
                               hidden.float() @ model.lm_head_weight.float().T,
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("min_rows", PAD_CHOICES)
def test_every_padding_gives_the_same_bits(dtype, min_rows):
    """1-3 rows padded to any of the choices equal those rows inside an 80-row product."""
    x, w = _activations(dtype, rows=80)
    packed = _packed_or_skip(w)
    full = linear(x, None, packed=packed)
    for m in (1, 2, 3):
        for start in (0, 13, 77):
            got = linear(x[start:start + m], None, packed=packed, min_rows=min_rows)
            assert got.shape == (m, 576) and torch.equal(got, full[start:start + m]), (m, start)


def test_fastest_min_rows_picks_a_choice():
    assert fastest_min_rows([]) == PAD_CHOICES[0]
    packed = pack_weight(torch.randn(256, 128))
    if packed is None:
        pytest.skip("oneDNN cannot pack float32 weights on this CPU")
    assert fastest_min_rows([packed] * 4, rounds=2) in set(PAD_CHOICES) | set(DIRECT_PAD_CHOICES)
