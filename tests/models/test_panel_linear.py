"""``models/panel_linear.py``: the compiled AVX2 bf16 product (and, where noted, the
AVX512_BF16 pair kernel beside it, ``test_pair_products.py``). Each output element is one chain
of fused multiply-adds in input order, then the bias, then one rounding to bf16, so its bits
are known exactly (emulated here in float64, where each step is exact) and cannot depend on
the row count, the row's batch mates or the thread split."""

from __future__ import annotations

import pytest
import torch

from attention import cpu_kernel
from models import onednn, panel_linear
from models.layers import linear, pack_weight


def _ops_or_skip():
    ops = cpu_kernel.load()
    if ops is None or not ops.bf16_linear_available():
        pytest.skip("the CPU kernels are not built with AVX2 and FMA here")
    return ops


def _data(rows: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g).pow(4) * 8)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    return x.bfloat16(), w.bfloat16(), b.bfloat16()


def _fma_chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float32 fused multiply-adds over k in order from zero, plus the bias, rounded to bf16.
    A bf16 x bf16 product has 16 significant bits and the running sum 24, so their float64 sum
    is exact (for magnitudes within 2^29 of each other, as here) and rounding it to float32 is
    exactly one fused multiply-add."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    xd, wd = x.double(), w.double()
    for k in range(x.shape[1]):
        acc = (acc.double() + xd[:, k:k + 1] * wd[:, k]).float()
    if b is not None:
        acc = acc + b.float()
    return acc.bfloat16()


@pytest.mark.parametrize("n,k", [(40, 24), (16, 64), (33, 7), (96, 50)])
def test_each_element_is_the_fused_chain_exactly(n, k):
    ops = _ops_or_skip()
    x, w, b = _data(13, n, k)
    packed = ops.bf16_linear_pack(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    assert torch.equal(ops.bf16_linear(x, packed, n, b), _fma_chain(x, w, b))
    assert torch.equal(ops.bf16_linear(x, packed, n), _fma_chain(x, w, None))


def test_close_to_the_plain_product_on_model_shapes():
    _ops_or_skip()
    x, w, _ = _data(9, 1536, 576)
    got = panel_linear.pack(w)(x).float()
    torch.testing.assert_close(got, x.float() @ w.float().T, rtol=1e-2, atol=2e-2)


KERNELS = [("bf16_linear_available", "bf16_linear_pack", "bf16_linear"),  # AVX2 panels
           ("bf16_dp_linear_available", "bf16_dp_linear_pack", "bf16_dp_linear")]  # pairs


def _kernel_or_skip(available: str, pack: str, run: str):
    ops = cpu_kernel.load()
    if ops is None or not getattr(ops, available)():
        pytest.skip(f"the CPU kernels are built without {run} here")
    return getattr(ops, pack), getattr(ops, run)


@pytest.mark.parametrize("kernel,pack",
                         list(zip(KERNELS, [panel_linear.pack, panel_linear.pack_pairs])),
                         ids=["panels", "pairs"])
def test_rows_do_not_depend_on_the_row_count_or_their_neighbours(kernel, pack):
    _kernel_or_skip(*kernel)
    x, w, b = _data(120, 200, 96)
    op = pack(w)
    full = op(x, b)
    # every tile shape of both kernels (one row; tiles of up to six; chunks of 48)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 47, 48, 49, 100):
        for start in (0, 5, 19):
            assert torch.equal(op(x[start:start + m], b), full[start:start + m]), (m, start)
    assert torch.equal(op(x.view(8, 15, 96), b), full.view(8, 15, 200))  # leading dims kept
    assert op(x[:0], b).shape == (0, 200)


@pytest.mark.parametrize("kernel", KERNELS, ids=["panels", "pairs"])
def test_nan_and_infinity_pass_through(kernel):
    pack, run = _kernel_or_skip(*kernel)
    x, w, _ = _data(3, 20, 16)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    y = run(x, pack(w), 20)
    assert torch.isnan(y[0]).all()
    ref = x[1:2].double() @ w.double().T
    assert torch.equal(torch.isinf(y[1]), torch.isinf(ref[0]))


@pytest.mark.parametrize("kernel", KERNELS, ids=["panels", "pairs"])
def test_bad_inputs_are_refused(kernel):
    pack, run = _kernel_or_skip(*kernel)
    x, w, b = _data(2, 20, 16)
    packed = pack(w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        run(x.float(), packed, 20)
    with pytest.raises(RuntimeError, match="inputs"):
        run(x[:, :8], packed, 20)
    with pytest.raises(RuntimeError, match=kernel[1]):
        run(x, packed, 200)
    with pytest.raises(RuntimeError, match="bias"):
        run(x, packed, 20, b[:5])
    with pytest.raises(RuntimeError, match="2-D bfloat16"):
        pack(w.float())


def test_pack_serves_bf16_weights_only_and_can_be_switched_off(monkeypatch):
    _ops_or_skip()
    _, w, _ = _data(1, 24, 16)
    assert panel_linear.pack(w.float()) is None
    assert panel_linear.pack(w.view(1, 24, 16)) is None
    assert panel_linear.pack(w).shape == (24, 16)
    monkeypatch.setenv("SPECSERVE_PANEL_LINEAR", "0")
    assert panel_linear.pack(w) is None


def test_pack_weight_takes_the_panels_where_onednn_has_no_bf16_product():
    _ops_or_skip()
    x, w, b = _data(10, 48, 32)
    if onednn.pack(w) is not None:
        pytest.skip("oneDNN has a direct bf16 product here; it serves first")
    packed = pack_weight(w)
    assert isinstance(packed, onednn.DirectPacked)
    assert isinstance(packed.op, panel_linear.PanelLinear)
    assert torch.equal(linear(x, None, b, packed=packed, min_rows=1), _fma_chain(x, w, b))
    assert torch.equal(linear(x[4:5], None, b, packed=packed, min_rows=1)[0], linear(
        x, None, b, packed=packed)[4])
