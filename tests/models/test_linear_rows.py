"""``models.layers.linear``: a row's result does not depend on how many rows the product has.

On an AVX-512-BF16 CPU, oneDNN's one-row bf16 product rounds differently from the product of
two or more rows; with heavy-tailed activations like a real model's, about one row in seven
differs in the last bit (measured here with plain ``F.linear``). A token decoded alone and the
same token verified inside a block of drafts must get the same logits, so ``linear`` never
multiplies a single reduced-precision row on its own."""

from __future__ import annotations

import pytest
import torch

from models.layers import Linear, linear


def _activations(dtype: torch.dtype, rows: int = 256, width: int = 1536) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(576, width, generator=g) * 0.02).to(dtype)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, width, generator=g).pow(4) * 8
    return x.to(dtype), w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_equals_the_row_in_a_batch(dtype):
    x, w = _activations(dtype)
    full = linear(x, w)
    differing = [i for i in range(x.shape[0]) if not torch.equal(linear(x[i:i + 1], w)[0], full[i])]
    assert differing == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_batches_equal_the_rows_in_a_large_one(dtype):
    x, w = _activations(dtype)
    full = linear(x, w)
    for m in (2, 3, 5, 8, 9, 16, 33):
        for start in (0, 7, 100):
            assert torch.equal(linear(x[start:start + m], w), full[start:start + m]), (m, start)


def test_linear_module_uses_the_row_stable_product():
    x, w = _activations(torch.bfloat16, rows=64)
    layer = Linear(w.shape[1], w.shape[0], bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.normal_()
        full = layer(x)
        for i in range(x.shape[0]):
            assert torch.equal(layer(x[i:i + 1])[0], full[i])
    assert layer(x[:1]).shape == (1, 576)
