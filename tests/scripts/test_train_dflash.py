"""Training pieces of the DFlash draft: mask, labels, loss weights, and that training learns."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


train = _load("train_dflash")


def loop_mask(seq_len: int, anchors: list[int], block: int) -> torch.Tensor:
    n = len(anchors)
    mask = torch.zeros(n * block, seq_len + n * block, dtype=torch.bool)
    for qi in range(n * block):
        blk = qi // block
        for j in range(seq_len):
            mask[qi, j] = j < anchors[blk]
        for kj in range(n * block):
            mask[qi, seq_len + kj] = kj // block == blk
    return mask


@pytest.mark.parametrize("seq_len,anchors,block", [(10, [2, 5], 4), (7, [0, 3, 6], 3), (12, [11], 5)])
def test_block_mask_matches_loop_reference(seq_len, anchors, block):
    assert torch.equal(train.block_mask(seq_len, anchors, block), loop_mask(seq_len, anchors, block))


def test_block_mask_context_is_strictly_before_anchor():
    mask = train.block_mask(8, [3], 2)
    assert mask[0, :3].all() and not mask[0, 3:8].any()


def test_labels_line_up_slot_k_to_anchor_plus_k():
    ids = torch.arange(100, 110)
    labels = train.block_labels(ids, [2, 7], 4)
    assert labels[0].tolist() == [-100, 103, 104, 105]
    assert labels[1].tolist() == [-100, 108, 109, -100]  # past the end is ignored


def test_position_weights_decay():
    w = train.position_weights(8, 4.0)
    assert w[0] == 0 and w[1] == 1.0
    assert torch.allclose(w[2], torch.exp(torch.tensor(-0.25)))
    assert (w[2:] < w[1:-1]).all()


def test_anchors_stay_in_the_response():
    rng = random.Random(0)
    anchors = train.sample_anchors(prompt_len=20, seq_len=40, count=50, rng=rng)
    assert anchors == sorted(set(anchors))
    assert min(anchors) >= 19 and max(anchors) <= 38


def _tiny_setup(tmp_path):
    from models.dflash import DFlashConfig, DFlashDraftModel
    from models.dflash_init import draft_hf_config
    from models.llama import DecoderConfig

    target = DecoderConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    )
    hf = draft_hf_config(target, num_layers=1, block_size=4, target_layer_ids=[1, 2])
    torch.manual_seed(0)
    draft = DFlashDraftModel(DFlashConfig.from_hf(hf), max_positions=256)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.05)
    embed = torch.randn(64, 32)
    draft.mask_embedding = torch.nn.Parameter(embed.mean(0))
    frozen = train.Frozen(embed=embed, head=embed)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(4):
        # a repetitive sequence whose next tokens are predictable from the features
        ids = torch.arange(40) % 7 + 3
        feats = embed[ids].repeat(1, 2) + 0.01 * torch.randn(40, 64, generator=gen)
        seqs.append(train.Sequence(ids=ids, feats=feats.half(), prompt_len=5))
    return draft, frozen, seqs


def test_a_few_training_steps_reduce_the_loss(tmp_path):
    draft, frozen, seqs = _tiny_setup(tmp_path)
    rng = random.Random(0)
    anchors = [train.sample_anchors(s.prompt_len, s.ids.shape[0], 6, rng) for s in seqs]

    def loss_now() -> float:
        with torch.no_grad():
            return sum(float(train.sequence_loss(draft, frozen, s, a, 3.0)[0])
                       for s, a in zip(seqs, anchors))

    before = loss_now()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        for s, a in zip(seqs, anchors):
            train.sequence_loss(draft, frozen, s, a, 3.0)[0].backward()
        opt.step()
    assert loss_now() < 0.5 * before


def test_dense_training_forward_equals_paged_draft_forward(tmp_path):
    """The training forward (dense mask) and the serving forward (paged, non-causal) agree."""
    from attention.backends.base import AttentionBatch
    from attention.backends.torch_backend import TorchBackend
    from attention.groups import LayerKVSpec, build_groups
    from engine.kv_pool import KVPool

    draft, frozen, seqs = _tiny_setup(tmp_path)
    cfg = draft.config
    seq = seqs[0]
    anchor, b = 13, cfg.block_size
    feats = seq.feats.float()
    emb = draft.mask_embedding.detach().expand(b, -1).clone()
    emb[0] = frozen.embed[seq.ids[anchor]]
    pos = torch.arange(anchor, anchor + b)
    with torch.no_grad():
        dense = train.dense_forward(draft, feats, emb, pos, train.block_mask(seq.ids.shape[0], [anchor], b))
        specs = [LayerKVSpec(n, "draft", cfg.num_kv_heads, cfg.head_dim, "auto", 4)
                 for n in draft.layer_names]
        groups = build_groups(specs, torch.float32)
        pool = KVPool(list(groups.values()), num_blocks=16, layout="NHD", device=torch.device("cpu"))
        kv = pool.layers(draft.layer_names)
        table = list(range(16))
        draft.write_context(feats[:anchor], torch.arange(anchor), torch.arange(anchor), kv)
        batch = AttentionBatch(q_lens=(b,), kv_lens=(anchor + b,), block_tables=(tuple(table),),
                               slot_mapping=pos, causal=False, block_size=4)
        paged = draft(emb, pos, TorchBackend().build_metadata(batch, torch.device("cpu")), kv)
    torch.testing.assert_close(dense, paged, atol=1e-5, rtol=1e-5)


def test_simulated_acceptance_counts_the_correct_prefix_plus_bonus():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    assert train.simulated_acceptance(hits) == (3 + 1 + 5) / 3
