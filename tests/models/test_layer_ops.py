"""The compiled CPU layer ops (``attention/csrc/layer_ops.cpp``) behind ``RMSNorm`` and ``SwiGLU``.

- close to PyTorch's composition (the fallback path) in float32, bfloat16 and float16;
- every output row is bitwise the same alone and inside batches of other rows (small batches run
  on one thread, large ones on several: both are compared);
- the residual sum is rounded to the dtype exactly as ``residual + x`` is;
- with gradients recorded (draft training), the modules take PyTorch's ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention import cpu_kernel
from models.layers import RMSNorm, SwiGLU, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason=f"CPU kernels unavailable: {cpu_kernel.error()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
HIDDEN = 576  # SmolLM2-135M's; 36 blocks of 16 lanes
ODD = 70  # a hidden size with a tail after the 16-lane blocks


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def make_norm(size: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size) + 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("size", [HIDDEN, ODD])
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rms_norm_matches_pytorch(dtype, size) -> None:
    torch.manual_seed(0)
    norm = make_norm(size, dtype)
    x = (torch.randn(33, size) * 3).to(dtype)
    assert cpu_ops(x, norm.weight) is not None
    torch.testing.assert_close(norm(x).float(), reference_norm(x, norm.weight, norm.eps).float(),
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_add_rms_norm_rounds_the_sum_like_pytorch(dtype) -> None:
    torch.manual_seed(1)
    norm = make_norm(HIDDEN, dtype)
    x = torch.randn(17, HIDDEN).to(dtype)
    residual = (torch.randn(17, HIDDEN) * 10).to(dtype)
    normed, total = norm.add(x, residual)
    assert torch.equal(total, residual + x)  # bitwise: the residual stream is PyTorch's
    torch.testing.assert_close(normed.float(), reference_norm(residual + x, norm.weight,
                                                              norm.eps).float(),
                               rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(normed, norm(total))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_silu_mul_vector_lanes_round_as_the_scalar_tail(dtype) -> None:
    """Rows of 9: the first 8 outputs take the 8-lane path where the build has one (AVX2 without
    AVX-512), the ninth the scalar loop; every value must come out with the same bits either
    way, extremes, zeros of both signs, infinities and NaN included."""
    torch.manual_seed(3)
    special = torch.tensor([-100.0, -87.5, -87.0, -0.0, 0.0, 1e-30, -1e-30, 90.0, 88.7,
                            float("inf"), float("-inf"), float("nan")])
    gate = torch.cat([special, torch.randn(200) * 8])
    up = torch.cat([torch.ones(len(special)), torch.randn(200) * 3])
    gate_up = torch.cat([gate[:, None].expand(-1, 9), up[:, None].expand(-1, 9)], dim=1)
    out = cpu_kernel.load().silu_mul(gate_up.to(dtype).contiguous())
    bits = out.view(torch.int16 if out.element_size() == 2 else torch.int32)
    assert torch.equal(bits[:, :8], bits[:, 8:].expand(-1, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_silu_mul_matches_pytorch(dtype) -> None:
    torch.manual_seed(2)
    mlp = SwiGLU(64, 96).to(dtype)
    gate_up = (torch.randn(9, 192) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -87.5, 0.0, 90.0])  # tails of exp and sigmoid
    gate, up = gate_up.split(96, dim=-1)
    ref = F.silu(gate) * up
    ours = cpu_kernel.load().silu_mul(gate_up)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.isfinite(ours).all()
    x = torch.randn(5, 64).to(dtype)
    with torch.no_grad():  # the module takes the same path
        expected = mlp.down_proj(cpu_kernel.load().silu_mul(mlp.gate_up_proj(x)))
    assert torch.equal(mlp(x), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_rows_are_batch_invariant(dtype) -> None:
    """Row ``i`` alone, in a batch of 4 and in a batch of 4096 (split between threads) gives the
    same bits, for each op."""
    torch.manual_seed(3)
    norm = make_norm(HIDDEN, dtype)
    mlp = SwiGLU(HIDDEN, 1536).to(dtype)
    rows = (torch.randn(4096, HIDDEN) * 2).to(dtype)
    other = torch.randn(4096, HIDDEN).to(dtype)
    gate_up = torch.randn(4096, 2 * 1536).to(dtype)
    ops = cpu_kernel.load()
    full_norm = norm(rows)
    full_add = norm.add(other, rows)
    full_silu = ops.silu_mul(gate_up)
    for i in (0, 7, 2049, 4095):
        for sl in (slice(i, i + 1), slice(max(0, i - 3), max(0, i - 3) + 4)):
            k = i - sl.start
            assert torch.equal(norm(rows[sl])[k], full_norm[i])
            normed, total = norm.add(other[sl], rows[sl])
            assert torch.equal(normed[k], full_add[0][i]) and torch.equal(total[k], full_add[1][i])
            assert torch.equal(ops.silu_mul(gate_up[sl])[k], full_silu[i])
    assert mlp(rows[:1]).shape == (1, HIDDEN)


@torch.inference_mode()
def test_strided_and_3d_inputs() -> None:
    """q/k norms see ``[N, H, D]`` views split off the QKV projection."""
    torch.manual_seed(4)
    norm = make_norm(64, torch.bfloat16)
    heads = torch.randn(5, 12, 64).to(torch.bfloat16)
    q = heads[:, :8]  # not contiguous
    assert torch.equal(norm(q), norm(q.contiguous()))
    torch.testing.assert_close(norm(q).float(), reference_norm(q, norm.weight, norm.eps).float(),
                               rtol=2e-2, atol=2e-2)


def test_gradients_take_pytorch_ops() -> None:
    norm = make_norm(ODD, torch.float32)
    x = torch.randn(3, ODD, requires_grad=True)
    assert cpu_ops(x, norm.weight) is None
    out, total = norm.add(x, torch.randn(3, ODD))
    (out.sum() + total.sum()).backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        assert cpu_ops(x, norm.weight) is not None


def test_mixed_dtypes_or_devices_take_pytorch_ops() -> None:
    with torch.no_grad():
        assert cpu_ops(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16)) is None
        assert cpu_ops(torch.zeros(2, 4, dtype=torch.float64)) is None
        assert cpu_ops(torch.zeros(2, 4, device="meta")) is None


@pytest.mark.parametrize("call", [
    lambda ops: ops.rms_norm(torch.zeros(2, 4), torch.zeros(5), 1e-5),
    lambda ops: ops.rms_norm(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16), 1e-5),
    lambda ops: ops.add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(4), 1e-5),
    lambda ops: ops.silu_mul(torch.zeros(2, 5)),
    lambda ops: ops.silu_mul(torch.zeros(2, 8, dtype=torch.int32)),
])
def test_bad_inputs_raise_precise_errors(call) -> None:
    with pytest.raises(RuntimeError, match="rms_norm|silu_mul"):
        call(cpu_kernel.load())


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rope_qk_has_the_bits_of_apply_rotary(dtype) -> None:
    """The fused RoPE rounds each product and the sum as ``apply_rotary``'s three ops do."""
    from models.layers import RotaryEmbedding, apply_rotary

    torch.manual_seed(5)
    nq, nk, d = 9, 3, 64
    rotary = RotaryEmbedding(d, 4096, 10000.0, None)
    positions = torch.tensor([0, 1, 17, 300, 4095])
    cos, sin = rotary.lookup(positions, dtype)
    heads = (torch.randn(5, nq + 2 * nk, d) * 4).to(dtype)
    q, k = cpu_kernel.load().rope_qk(heads, cos, sin, nq, nk)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, apply_rotary(heads[:, :nq], cos, sin))
    assert torch.equal(k, apply_rotary(heads[:, nq : nq + nk], cos, sin))
    with pytest.raises(RuntimeError, match="rope_qk"):
        cpu_kernel.load().rope_qk(heads, cos, sin, nq, 2 * nk + 1)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rope_qk_with_norms_has_the_bits_of_norm_then_rotary(dtype) -> None:
    """Qwen3's q/k RMSNorms fused before the rotation: the bits of ``RMSNorm`` and then
    ``apply_rotary``, for queries and keys alike, and for the keys alone (nq = 0)."""
    from models.layers import RMSNorm, RotaryEmbedding, apply_rotary

    torch.manual_seed(6)
    nq, nk, d = 9, 3, 64
    rotary = RotaryEmbedding(d, 4096, 10000.0, None)
    cos, sin = rotary.lookup(torch.tensor([0, 5, 17, 300, 4095]), dtype)
    heads = (torch.randn(5, nq + 2 * nk, d) * 4).to(dtype)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(dtype), RMSNorm(d, 1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(d) + 0.5)
        k_norm.weight.copy_(torch.rand(d) + 0.5)
    ops = cpu_kernel.load()
    q, k = ops.rope_qk(heads, cos, sin, nq, nk, q_norm.weight, k_norm.weight, 1e-6)
    assert torch.equal(q, apply_rotary(q_norm(heads[:, :nq].contiguous()), cos, sin))
    assert torch.equal(k, apply_rotary(k_norm(heads[:, nq:nq + nk].contiguous()), cos, sin))
    kv = heads[:, nq:].contiguous()
    none, k_only = ops.rope_qk(kv, cos, sin, 0, nk, None, k_norm.weight, 1e-6)
    assert none.numel() == 0 and torch.equal(k_only, k)
    with pytest.raises(RuntimeError, match="rope_qk"):
        ops.rope_qk(heads, cos, sin, nq, nk, q_norm.weight[:8], k_norm.weight, 1e-6)
