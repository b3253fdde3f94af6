"""The compiled greedy choice (``attention/csrc/sampling_ops.cpp``) behind ``models.layers.argmax``:
the indices of ``torch.argmax(dim=-1)`` in every case that decides them: ties (the first wins,
-0 equals +0), NaN (the first NaN wins), infinities, all-equal rows, lengths around the kernel's
64-score chunks, float32/bfloat16/float16, and shapes it leaves to PyTorch."""

from __future__ import annotations

import pytest
import torch

from attention import cpu_kernel
from models.layers import argmax

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason=f"CPU kernels unavailable: {cpu_kernel.error()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def kernel(x: torch.Tensor) -> torch.Tensor:
    return cpu_kernel.load().argmax_rows(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 63, 64, 65, 200, 8192])
def test_ties_and_specials_match_torch(dtype, width) -> None:
    torch.manual_seed(width)
    # few distinct values: many rows tie at their maximum, sometimes across chunk borders
    x = (torch.randint(-3, 3, (12, width)) * 0.5).to(dtype)
    x[1] = 0.0
    x[1, : width // 2] = -0.0  # -0 first: it is the first maximum (equal to +0)
    x[2] = float("-inf")
    x[3, width // 3] = float("nan")
    x[3, -1] = float("nan")
    x[4] = float("nan")
    x[5, -1] = float("inf")
    x[6] = -1.0
    x[6, -1] = -0.5  # the maximum in the last score
    x[7, 0] = 7.0  # in the first
    x[8] = float("-inf")
    x[8, width // 2] = float("nan")
    x[9] = -torch.arange(width, dtype=torch.float32).to(dtype) - 1  # all negative, first wins
    assert torch.equal(kernel(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_vocabulary_rows_match_torch(dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(40, 49152) * 4).to(dtype)  # bf16 and fp16 round many scores together
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x[7]), x[7].argmax())  # one row, 0-d result
    y = x.view(5, 8, -1)
    assert torch.equal(argmax(y), y.argmax(dim=-1))


def test_other_inputs_take_torch() -> None:
    x = torch.randn(6, 100)
    strided = x[:, ::2]
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))
    ints = torch.randint(0, 9, (3, 40))
    assert torch.equal(argmax(ints), ints.argmax(dim=-1))
    with pytest.raises(IndexError):
        argmax(torch.empty(3, 0))  # PyTorch's own error
    with pytest.raises(RuntimeError, match="non-empty last dim"):
        kernel(torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernel(ints)
