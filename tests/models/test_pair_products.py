"""The AVX512_BF16 pair kernel (``models/panel_linear.py``, ``bf16_dp_linear``): panels of input
pairs, one chain of pair products per output element in input order. Its rows cannot depend on
the row count, their batch mates, the tiling or the thread split; the engine measures whether
it serves (``engine.dtype_choice.auto_products``)."""

from __future__ import annotations

import logging

import pytest
import torch

from attention import cpu_kernel
from models import panel_linear
from models.layers import PRODUCTS, linear, pack_weight
from models.onednn import DirectPacked
from test_panel_linear import _data  # heavy-tailed bf16 rows, weights and bias
# (row-count invariance: test_panel_linear.py, for both kernels)


def _ops_or_skip():
    ops = cpu_kernel.load()
    if ops is None or not ops.bf16_dp_linear_available():
        pytest.skip("the CPU kernels are not built with AVX512_BF16 here")
    return ops




@pytest.mark.parametrize("n,k", [(40, 24), (16, 64), (33, 8), (200, 96), (1000, 576)])
def test_close_to_the_exact_product_with_and_without_bias(n, k):
    ops = _ops_or_skip()
    x, w, b = _data(13, n, k)
    packed = ops.bf16_dp_linear_pack(w)
    panels = (n + 15) // 16
    assert packed.shape == ((panels + 7) // 8 * 8, k // 2, 16) and packed.dtype == torch.int32
    exact = x.double() @ w.double().T
    for bias in (None, b):
        got = ops.bf16_dp_linear(x, packed, n, bias).double()
        want = exact if bias is None else exact + bias.double()
        # float32 sums rounded once to bf16: within a bf16 rounding of the exact sum
        assert (got - want).abs().le(want.abs() * 2.0**-8 + 1e-3).all()


def test_thread_count_does_not_change_the_bits():
    _ops_or_skip()
    x, w, b = _data(37, 520, 64)
    op = panel_linear.pack_pairs(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(op(x, b), one)


def test_pack_pairs_serves_even_bf16_weights_and_can_be_switched_off(monkeypatch):
    _ops_or_skip()
    _, w, _ = _data(1, 24, 16)
    assert panel_linear.pack_pairs(w.float()) is None
    assert panel_linear.pack_pairs(w[:, :15].contiguous()) is None  # an odd number of inputs
    assert panel_linear.pack_pairs(w).shape == (24, 16)
    monkeypatch.setenv("SPECSERVE_PAIR_PRODUCTS", "0")
    assert not panel_linear.pairs_available() and panel_linear.pack_pairs(w) is None


def test_pack_weight_takes_the_pairs_only_when_asked():
    _ops_or_skip()
    x, w, b = _data(10, 48, 32)
    packed = pack_weight(w, "pairs")
    assert isinstance(packed, DirectPacked) and isinstance(packed.op, panel_linear.PanelLinear)
    assert torch.equal(packed(x, b), panel_linear.pack_pairs(w)(x, b))
    assert torch.equal(linear(x[4:5], None, b, packed=packed, min_rows=1)[0],
                       linear(x, None, b, packed=packed)[4])
    default = pack_weight(w)
    assert not (isinstance(default, DirectPacked) and
                getattr(default.op, "_forward", None) is packed.op._forward)
    assert pack_weight(w.float(), "pairs") is not None  # float32: the pairs do not apply
    with pytest.raises(ValueError, match="products"):
        pack_weight(w, "mkl")


def test_a_model_packs_every_product_with_the_pairs(tiny_llama_dir):
    _ops_or_skip()
    from models.loader import load_target
    from models.hf_folder import load_hf_config

    hf = load_hf_config(tiny_llama_dir)
    model = load_target(tiny_llama_dir, hf, torch.bfloat16, 64, torch.device("cpu"),
                        products="pairs")
    assert model.products == "pairs"
    ops = [m.packed.op for m in model.layers.modules() if getattr(m, "packed", None) is not None]
    ops.append(model.head_packed.op)
    assert ops and all(isinstance(op, panel_linear.PanelLinear) and
                       op._forward is cpu_kernel.load().bf16_dp_linear for op in ops)
    assert PRODUCTS == ("onednn", "pairs")


def test_auto_products_picks_the_measured_faster_and_caches_it(monkeypatch, tmp_path, caplog):
    import engine.dtype_choice as dc

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(panel_linear, "pairs_available", lambda: True)
    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 2}
    calls = []
    speed = {"onednn": 2.0, "pairs": 1.0}

    def fake(shapes, dtype, device, rows, products="onednn"):
        calls.append((dtype, products))
        return lambda: [speed[products]] * len(rows)

    monkeypatch.setattr(dc, "decode_step_timer", fake)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="specserve"):
        assert dc.auto_products(hf, cpu, torch.bfloat16) == "pairs"
    assert "bf16 products: pairs" in caplog.text
    assert sorted(calls) == [(torch.bfloat16, "onednn"), (torch.bfloat16, "pairs")]
    speed.update(onednn=0.5)  # cached: not measured again
    assert dc.auto_products(hf, cpu, torch.bfloat16) == "pairs" and len(calls) == 2
    for f in (tmp_path / "measurements").glob("products-*.json"):
        f.write_text("not json")
    assert dc.auto_products(hf, cpu, torch.bfloat16) == "onednn" and len(calls) == 4
    # nothing to choose: float32, or the kernel not built
    assert dc.auto_products(hf, cpu, torch.float32) == "onednn"
    monkeypatch.setattr(panel_linear, "pairs_available", lambda: False)
    assert dc.auto_products(hf, cpu, torch.bfloat16) == "onednn" and len(calls) == 4
