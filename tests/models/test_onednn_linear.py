"""The direct oneDNN products (``models/onednn.py``): the values of ``F.linear``, rows whose bits
do not depend on the row count (one row included, so it needs no padding), and the fallback to
PyTorch's packed path wherever that cannot be promised."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import onednn
from models.layers import (DIRECT_PAD_CHOICES, Linear, fastest_min_rows, linear, pack_weight)

ROOT = Path(__file__).resolve().parents[2]


def _activations(dtype, rows=96, width=1536, out=576, seed=0):
    """Heavy-tailed rows like a real model's (as in test_linear_rows.py)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, width, generator=g) * 0.02).to(dtype)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, width, generator=g).pow(4) * 8
    return x.to(dtype), w


def _direct_or_skip(w):
    packed = onednn.pack(w)
    if packed is None:
        pytest.skip(f"no direct oneDNN product for {w.dtype} here: {onednn.error() or 'kernel'}")
    return packed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_are_those_of_f_linear(dtype):
    x, w = _activations(dtype, rows=40)
    packed = _direct_or_skip(w)
    assert packed.shape == (576, 1536) and packed.dtype == dtype
    bias = torch.randn(576).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    got = linear(x, None, bias, packed=packed)
    assert got.dtype == dtype and got.shape == (40, 576)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # leading dims are kept, an empty batch is fine
    assert packed(x.view(4, 10, 1536)).shape == (4, 10, 576)
    assert packed(x[:0]).shape == (0, 576)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_row_count_from_one_row_on(dtype):
    x, w = _activations(dtype, rows=300)
    packed = _direct_or_skip(w)
    full = packed(x)
    # with AMX, single calls of 150, 182 or 200 rows of this shape rounded some rows differently
    for m in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65, 128, 129, 150, 182, 200, 257):
        for start in (0, 7, 300 - m):
            got = linear(x[start:start + m], None, packed=packed, min_rows=1)
            assert torch.equal(got, full[start:start + m]), (m, start)
    bias = torch.randn(576).to(dtype)
    with_bias = packed(x, bias)
    assert all(torch.equal(packed(x[i:i + 1], bias)[0], with_bias[i]) for i in (0, 150, 299))


def test_a_wide_product_is_held_to_its_measured_row_range():
    """With AMX, oneDNN runs 1-12 rows of an [8192, 576] bf16 product on AVX-512 kernels and
    more on AMX (different bits): such calls are padded up to the measured range."""
    x, w = _activations(torch.bfloat16, rows=300, width=576, out=8192)
    packed = _direct_or_skip(w)
    lo, hi = packed.op.min_rows, packed.op.max_rows
    assert 1 <= lo and hi >= 2 * lo
    full = packed(x)
    if lo > 1:  # the range is there for a reason: unpadded, fewer rows round differently
        raw = onednn.load().PackedLinear(w)
        assert not torch.equal(raw.forward(x[:lo - 1]), full[:lo - 1])
    assert [packed.op.call_rows(n) for n in (1, 33, 64, 65, 81, hi)] == [lo, 33, 64, 80, 96, hi]
    for m in (*range(1, 20), 33, 47, 64, 65, 127, 128, 129, 128 + lo - 1, 200, 299):
        start = 300 - m if m % 2 else 0
        assert torch.equal(packed(x[start:start + m]), full[start:start + m]), (m, lo, hi)


def test_a_row_range_must_leave_room_for_splitting():
    _, w = _activations(torch.float32, rows=1)
    packed = _direct_or_skip(w)
    for lo, hi in ((0, 8), (5, 8), (1, 72)):  # 72: above 64 rows, calls come in steps of 16
        with pytest.raises(RuntimeError, match="row range"):
            packed.op.set_row_range(lo, hi)


@pytest.mark.parametrize("min_rows", DIRECT_PAD_CHOICES)
def test_any_padding_gives_the_same_bits(min_rows):
    x, w = _activations(torch.bfloat16, rows=40)
    packed = _direct_or_skip(w)
    full = packed(x)
    for m in (1, 2, 3):
        got = linear(x[5:5 + m], None, packed=packed, min_rows=min_rows)
        assert torch.equal(got, full[5:5 + m])


def test_bad_inputs_raise_precise_errors():
    x, w = _activations(torch.float32, rows=4)
    packed = _direct_or_skip(w)
    with pytest.raises(RuntimeError, match="input is"):
        packed(x.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dim"):
        packed(x[:, :100])
    with pytest.raises(RuntimeError, match="bias has"):
        packed(x, torch.zeros(3))


def test_pack_weight_and_the_linear_module_take_the_direct_path():
    x, w = _activations(torch.bfloat16, rows=16)
    _direct_or_skip(w)
    assert isinstance(pack_weight(w), onednn.DirectPacked)
    layer = Linear(w.shape[1], w.shape[0], bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.normal_()
        before = layer(x)
        layer.pack()
        assert isinstance(layer.packed, onednn.DirectPacked) and layer.weight is None
        layer.min_rows = 1
        torch.testing.assert_close(layer(x).float(), before.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(layer(x[3:4])[0], layer(x)[3])
    assert fastest_min_rows([pack_weight(w)] * 4, rounds=2) in DIRECT_PAD_CHOICES


def test_a_torch_packed_weight_is_still_padded_to_two_rows(monkeypatch):
    """``min_rows=1`` is for direct products only: PyTorch's one-row kernel rounds differently."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("with AMX, PyTorch's bf16 products are not row-count invariant from two rows "
                    "on either (tests/models/test_linear_rows.py): the direct path serves")
    x, w = _activations(torch.bfloat16, rows=80)
    monkeypatch.setenv("SPECSERVE_ONEDNN", "0")
    monkeypatch.setenv("SPECSERVE_PANEL_LINEAR", "0")  # the panel kernel pads nothing either
    packed = pack_weight(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    assert isinstance(packed, torch.Tensor)
    full = linear(x, None, packed=packed)
    assert all(torch.equal(linear(x[i:i + 1], None, packed=packed, min_rows=1)[0], full[i])
               for i in range(80))


def _run(code: str, **env) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True, env={**os.environ, **env}, timeout=300).stdout


def test_without_brgemm_kernels_pytorchs_path_serves():
    """With oneDNN held to AVX2 (what an AVX2-only CPU has), float32 gets oneDNN's gemm
    kernel, which is not row-count invariant, and bfloat16 gets no kernel: neither is packed
    for the direct path, and pack_weight falls back to PyTorch's (or to nothing)."""
    if onednn.load() is None:
        pytest.skip(f"direct oneDNN products not built: {onednn.error()}")
    out = _run(
        "import torch\n"
        "from models import onednn\n"
        "from models.layers import pack_weight\n"
        "w = torch.randn(960, 576)\n"
        "print(onednn.pack(w), onednn.pack(w.bfloat16()), type(pack_weight(w)).__name__)\n",
        ONEDNN_MAX_CPU_ISA="AVX2")
    assert out.split() == ["None", "None", "Tensor"]


def test_one_openmp_runtime_is_shared_with_torch():
    """The wheel's library asks for libgomp.so.1; torch's copy is already loaded under that
    name, so both run on one OpenMP pool (one thread count, no second set of spinning
    threads)."""
    if onednn.load() is None:
        pytest.skip(f"direct oneDNN products not built: {onednn.error()}")
    out = _run(
        "import re, torch\n"
        "from models import onednn\n"
        "onednn.pack(torch.randn(64, 64))\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(len(set(re.findall(r'\\S*libgomp\\S*', maps))), "
        "len(set(re.findall(r'\\S*libdnnl\\S*', maps))))\n")
    assert out.split() == ["1", "1"]


def test_primitives_are_shared_by_shape_and_their_cache_is_bounded():
    """Every weight of one shape uses the same primitive per row count, the probe makes every
    count a packed weight's calls run as (none is made while serving), and the cache keeps at
    most SPECSERVE_ONEDNN_CACHE primitives (raw calls bring new row counts all the time)."""
    _direct_or_skip(torch.randn(48, 32))  # an AVX2-only CPU has no direct float32 product
    out = _run(
        "import torch\n"
        "from models import onednn\n"
        "mod = onednn.load()\n"
        "ws = [torch.randn(48, 32) for _ in range(6)]\n"
        "first = onednn.pack(ws[0])\n"
        "probed = mod.cache_size()\n"
        "ps = [first] + [onednn.pack(w) for w in ws[1:]]\n"
        "outs = [p(torch.randn(rows, 32)) for rows in range(1, 300, 7) for p in ps]\n"
        "x = torch.randn(71, 32)\n"
        "ok = all(torch.allclose(p(x), x @ w.T, atol=1e-4) for p, w in zip(ps, ws))\n"
        "served = mod.cache_size()\n"
        "raw = mod.PackedLinear(ws[0])\n"
        "for rows in range(1, 200):\n"
        "    raw.forward(torch.randn(rows, 32))\n"
        "print(probed, served, ok, mod.cache_size(), mod.cache_capacity())\n",
        SPECSERVE_ONEDNN_CACHE="64")
    probed, served, ok, size, capacity = out.split()
    assert 1 < int(probed) == int(served) <= 64 and ok == "True"
    assert int(size) == int(capacity) == 64
