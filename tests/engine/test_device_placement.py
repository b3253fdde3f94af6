"""Model state follows the model to its device (checked on CPU with the ``meta`` device)."""

from __future__ import annotations

import pytest
import torch

from models.dflash import DFlashConfig, DFlashDraftModel
from models.layers import RotaryEmbedding, apply_rotary
from models.llama import DecoderConfig, LlamaForCausalLM

CFG = DecoderConfig(
    architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
    attention_bias=False, qk_norm=True,
)


def test_rope_tables_follow_the_model_and_stay_float32() -> None:
    model = LlamaForCausalLM(CFG, max_positions=128)
    cos = model.rotary.cos.clone()
    model = model.to(torch.bfloat16)
    assert model.rotary.cos.dtype == torch.float32
    assert torch.equal(model.rotary.cos, cos)  # not rounded through bf16
    model = model.to("meta")
    assert model.rotary.cos.device.type == model.rotary.sin.device.type == "meta"
    assert model.rotary.cos.dtype == torch.float32
    assert not any("rotary" in k for k in model.state_dict())  # not part of checkpoints


def test_rope_lookup_unchanged() -> None:
    rope = RotaryEmbedding(8, 64, 1e4, None)
    pos = torch.tensor([0, 5, 63])
    cos, sin = rope.lookup(pos, torch.float32)
    assert cos.shape == (3, 1, 8)
    inv = 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(cos[1, 0, :4], torch.cos(5 * inv))
    torch.testing.assert_close(sin[2, 0, 4:], torch.sin(63 * inv))
    torch.testing.assert_close(sin[2, 0, :4], -torch.sin(63 * inv))  # apply_rotary's sign


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_has_the_bits_of_rotate_half(dtype) -> None:
    """``apply_rotary`` with the signed table equals Hugging Face's ``x*cos + rotate_half(x)*sin``
    bitwise, for Q and K heads rotated together or apart."""
    rope = RotaryEmbedding(16, 64, 1e4, None)
    pos = torch.tensor([0, 3, 17, 63])
    x = (torch.randn(4, 5, 16) * 3).to(dtype)
    angles = pos[:, None].float() * (1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16)))[None]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    expected = x * cos + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin
    together = apply_rotary(x, *rope.lookup(pos, dtype))
    assert torch.equal(together, expected)
    assert torch.equal(apply_rotary(x[:, 3:], *rope.lookup(pos, dtype)), together[:, 3:])


def test_mask_embedding_lands_on_the_draft_device_and_dtype() -> None:
    cfg = DFlashConfig(
        hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, attention_bias=False,
        block_size=4, target_layer_ids=(0, 1), mask_token_id=None, num_target_layers=2,
    )
    with torch.device("meta"):
        draft = DFlashDraftModel(cfg, max_positions=32)
    draft = draft.to(torch.bfloat16)
    draft.set_mask_embedding(torch.randn(32))  # loaded on the CPU, in float32
    assert draft.mask_embedding.device.type == "meta"
    assert draft.mask_embedding.dtype == torch.bfloat16
    assert draft.rotary.cos.device.type == "meta"
