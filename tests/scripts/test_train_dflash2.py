"""Training DFlash2 drafts: the dense training forward equals the served one, the selector
objective agrees with the served greedy selection, training learns (convolutions and
selector), and ``train()`` writes a draft the reference package and our server both load."""

from __future__ import annotations

import random

import pytest
import torch

from .script_loader import load_script
from .test_train_dflash import _tiny_target_config

train = load_script("train_dflash")

DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}


def _tiny_setup(seed=0, std=0.05):
    from models.dflash2 import DFlash2DraftModel, draft_config
    from models.dflash_init import draft_hf_config

    target = _tiny_target_config()
    hf = draft_hf_config(target, num_layers=1, block_size=4, target_layer_ids=[1, 2], dflash2=DFLASH2)
    torch.manual_seed(seed)
    draft = DFlash2DraftModel(draft_config(hf), max_positions=256)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * std)
    embed = torch.randn(64, 32)
    draft.mask_embedding = torch.nn.Parameter(embed.mean(0))
    frozen = train.Frozen(embed=embed, head=embed)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(4):
        # each token determines the next one, but the features of a position only say which
        # token is there: predicting two ahead needs the previous *predicted* token
        ids = (torch.arange(40) * 5 + i) % 11 + 3
        feats = embed[ids].repeat(1, 2) + 0.01 * torch.randn(40, 64, generator=gen)
        seqs.append(train.Sequence(ids=ids, feats=feats.half(), prompt_len=5))
    return draft, frozen, seqs, hf


def test_dense_training_forward_equals_paged_draft_forward():
    from attention.backends.base import AttentionBatch
    from attention.backends.torch_backend import TorchBackend
    from attention.groups import LayerKVSpec, build_groups
    from engine.kv_pool import KVPool

    draft, frozen, seqs, _ = _tiny_setup(std=0.2)
    cfg = draft.config
    seq, b = seqs[0], cfg.block_size
    anchors = [9, 13, 30]
    feats = seq.feats.float()
    embs, dense_out = [], None
    for a in anchors:
        emb = draft.mask_embedding.detach().expand(b, -1).clone()
        emb[0] = frozen.embed[seq.ids[a]]
        embs.append(emb)
    pos = torch.cat([torch.arange(a, a + b) for a in anchors])
    with torch.no_grad():
        dense_out = train.dense_forward(draft, feats, torch.cat(embs), pos,
                                        train.block_mask(seq.ids.shape[0], anchors, b), block_len=b)
        for i, a in enumerate(anchors):  # each block served alone over its own context
            specs = [LayerKVSpec(n, "draft", cfg.num_kv_heads, cfg.head_dim, "auto", 4)
                     for n in draft.layer_names]
            pool = KVPool(list(build_groups(specs, torch.float32).values()), num_blocks=16,
                          layout="NHD", device=torch.device("cpu"))
            kv = pool.layers(draft.layer_names)
            draft.write_context(feats[:a], torch.arange(a), torch.arange(a), kv)
            p = torch.arange(a, a + b)
            batch = AttentionBatch(q_lens=(b,), kv_lens=(a + b,), block_tables=(tuple(range(16)),),
                                   slot_mapping=p, causal=False, block_size=4)
            paged = draft(embs[i], p, TorchBackend().build_metadata(batch, torch.device("cpu")), kv,
                          block_len=b)
            torch.testing.assert_close(dense_out[i * b:(i + 1) * b], paged, atol=1e-5, rtol=1e-5)


def test_selector_objective_picks_what_serving_selects():
    """Teacher forcing on the served greedy path reproduces that path: the training pick at
    each position is the selector's choice given the true predecessor."""
    draft, frozen, _, _ = _tiny_setup(std=0.3)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 4, 32, generator=g)
    logits = h @ frozen.head.T
    anchors = torch.tensor([4, 9, 20])
    with torch.no_grad():
        path = draft.candidate_selector.select(h, logits, anchors).tokens  # [3, 4]
        prev = torch.cat([anchors[:, None], path[:, :-1]], 1)
        ce, present, pick = train.selector_terms(draft, frozen, h.reshape(12, 32),
                                                 logits.reshape(12, 64), prev.reshape(-1),
                                                 path.reshape(-1))
    assert pick.tolist() == path.reshape(-1).tolist()
    assert present.all() and (ce > 0).all()


def test_training_learns_convolutions_and_selector():
    draft, frozen, seqs, _ = _tiny_setup()
    rng = random.Random(0)
    anchors = [train.sample_anchors(s.prompt_len, s.ids.shape[0], 6, rng) for s in seqs]
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}

    def loss_now() -> float:
        with torch.no_grad():
            return sum(float(train.sequence_loss(draft, frozen, s, a, 3.0)[0])
                       for s, a in zip(seqs, anchors))

    start = loss_now()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        for s, a in zip(seqs, anchors):
            train.sequence_loss(draft, frozen, s, a, 3.0)[0].backward()
        opt.step()
    assert loss_now() < 0.5 * start
    for name in ("layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook.weight",
                 "candidate_selector.hidden_projection.weight"):
        assert not torch.equal(dict(draft.named_parameters())[name], before[name]), name


def test_train_end_to_end_writes_a_dflash2_draft(tmp_path):
    """``train(--dflash2)`` on a tiny stored dataset: the saved draft loads in the reference
    package and in ours with equal weights, and serves with greedy output equal to plain."""
    from dflash.model import DFlash2DraftModel as Ref

    from models.dflash2 import DFlash2Config, DFlash2DraftModel
    from models.hf_folder import iter_safetensors, load_hf_config
    from tests.spec.helpers import greedy, make_llm, random_prompts, save_target, token_ids

    target = save_target(tmp_path / "target", "llama", vocab=64, hidden=32, layers=4, seed=3)
    data = tmp_path / "data"
    data.mkdir()
    gen = torch.Generator().manual_seed(0)
    ids, lens = [], []
    for i in range(24):
        n = 30 + i % 5
        ids.append((torch.arange(n) * (1 + i % 3)) % 17 + 3)
        lens.append(n)
    all_ids = torch.cat(ids)
    feats = torch.randn(all_ids.shape[0], 3 * 32, generator=gen).to(torch.bfloat16)
    torch.save({"features": feats, "ids": all_ids, "lengths": torch.tensor(lens),
                "prompt_lengths": torch.tensor([6] * 24)}, data / "features-0000.pt")
    (data / "features.json").write_text(
        '{"layers": [0, 1, 2], "dtype": "bfloat16", "shards": ["features-0000.pt"]}')
    out = tmp_path / "run"
    argv = ["--data", str(data), "--out", str(out), "--model", str(target), "--layers", "1",
            "--taps", "1", "2", "--block-size", "4", "--ffn", "48", "--anchors", "4",
            "--batch", "4", "--val-sequences", "4", "--epochs", "1", "--max-positions", "64",
            "--dflash2", "--conv-kernel-size", "3", "--conv-group-size", "8",
            "--selector-rank", "4", "--selector-top-k", "5"]
    metrics = train.train(train.parser().parse_args(argv))
    assert metrics["steps"] == 5 and metrics["best_sim_accept_len"] >= 1.0
    hf = load_hf_config(out / "draft")
    assert hf["architectures"] == ["DFlash2DraftModel"]
    ours = DFlash2DraftModel(DFlash2Config.from_hf(hf), 64)
    ours.load_weights(iter_safetensors(out / "draft"))
    ref = Ref.from_pretrained(out / "draft", dtype=torch.float32)
    mine = {n: p.float() for n, p in ours.named_parameters()}
    for name, p in ref.state_dict().items():
        if name in mine:
            assert torch.equal(mine[name], p.float()), name
    # the trained convolutions moved away from their identity start
    assert not torch.equal(mine["layers.0.attention_conv.kernel_projection.weight"],
                           torch.zeros_like(mine["layers.0.attention_conv.kernel_projection.weight"]))
    # and the draft serves (with its mask embedding), greedy output equal to plain greedy
    prompts = random_prompts([7, 12], vocab=64, seed=3)
    want = token_ids(make_llm(target, None).generate(prompts, [greedy(12)] * 2))
    llm = make_llm(target, {"method": "dflash2", "model": str(out / "draft"),
                            "num_speculative_tokens": 3, "adaptive": False})
    assert token_ids(llm.generate(prompts, [greedy(12)] * 2)) == want
    assert llm.get_spec_decoding_stats().num_drafts > 0


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is much faster than two on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_selector_learns_sequence_structure_that_per_position_drafting_misses(one_thread):
    """Synthetic: tokens follow a fixed successor map (10% noise) and the target features carry
    no information, so a block position can only know its token through the tokens before
    it. Trained the same way on the same data, the DFlash2 draft (selector: a low-rank
    predecessor/successor term) reaches a much longer simulated acceptance than DFlash."""
    from models.dflash2 import build_draft, draft_config
    from models.dflash_init import draft_hf_config

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=g)
    succ = torch.randperm(40, generator=g) + 3

    def sequence(i):
        ids = [3 + i % 40]
        for _ in range(39):
            nxt = int(succ[ids[-1] - 3])
            if torch.rand(1, generator=g) < 0.1:
                nxt = 3 + int(torch.randint(0, 40, (1,), generator=g))
            ids.append(nxt)
        feats = torch.randn(40, 64, generator=g)
        return train.Sequence(ids=torch.tensor(ids), feats=feats.half(), prompt_len=2)

    seqs, val = [sequence(i) for i in range(40)], [sequence(100 + i) for i in range(10)]
    frozen = train.Frozen(embed=embed, head=embed)
    results = {}
    for kind, dflash2 in (("dflash", None), ("dflash2", {"conv_kernel_size": 3, "conv_group_size": 8,
                                                         "selector_rank": 16, "selector_top_k": 8})):
        hf = draft_hf_config(_tiny_target_config(), num_layers=1, block_size=4,
                             target_layer_ids=[1, 2], dflash2=dflash2)
        draft = build_draft(draft_config(hf), 256)
        torch.manual_seed(0)
        with torch.no_grad():  # the initialisation train_dflash uses
            for name, p in draft.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("conv.base_kernel"):
                    p.zero_()
                    p[:, 0] = 1.0
                elif name.endswith("kernel_projection.weight"):
                    p.zero_()
                else:
                    p.normal_(0, 0.05)
        draft.mask_embedding = torch.nn.Parameter(embed.mean(0))
        opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
        rng = random.Random(0)
        for _ in range(150):
            opt.zero_grad()
            for s in rng.sample(seqs, 8):
                anchors = train.sample_anchors(s.prompt_len, 40, 8, rng)
                (train.sequence_loss(draft, frozen, s, anchors, 3.0)[0] / 8).backward()
            opt.step()
        results[kind] = train.evaluate(draft, frozen, val, 8, 3.0)
    d1, d2 = results["dflash"], results["dflash2"]
    assert d2["sim_accept_len"] > d1["sim_accept_len"] + 0.5, (d1, d2)
    assert d2["acc_per_pos"][2] > d1["acc_per_pos"][2] + 0.2, (d1, d2)
