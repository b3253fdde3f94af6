"""Training pieces of the DFlash draft: mask, labels, loss weights, and that training learns."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from .script_loader import load_script

train = load_script("train_dflash")


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


def _tiny_target_config():
    from models.llama import DecoderConfig

    return DecoderConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    )


def _tiny_setup(tmp_path, refine_passes: int = 0):
    from models.dflash import DFlashConfig, DFlashDraftModel
    from models.dflash_init import draft_hf_config

    target = _tiny_target_config()
    hf = draft_hf_config(target, num_layers=1, block_size=4, target_layer_ids=[1, 2],
                         refine_passes=refine_passes)
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


@pytest.mark.parametrize("refine_passes", [0, 1])
def test_a_few_training_steps_reduce_the_loss(tmp_path, refine_passes):
    draft, frozen, seqs = _tiny_setup(tmp_path, refine_passes=refine_passes)
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


def _two_passes(draft, frozen, seq, anchor):
    """Pass 0 (MASK) and pass 1 of a block, dense: pass 1 sees pass 0's greedy guesses where
    their probability reaches ``refine_threshold``, MASK elsewhere. Returns both passes'
    states, the guesses and where they were taken."""
    b = draft.config.block_size
    feats = seq.feats.float()
    mask = train.block_mask(seq.ids.shape[0], [anchor], b)
    pos = torch.arange(anchor, anchor + b)
    emb = draft.mask_embedding.detach().expand(b, -1).clone()
    emb[0] = frozen.embed[seq.ids[anchor]]
    first = train.dense_forward(draft, feats, emb, pos, mask)
    sure, guess = (first[1:] @ frozen.head.t()).softmax(-1).max(-1)
    taken = sure >= draft.config.refine_threshold
    emb[1:][taken] = frozen.embed[guess[taken]]
    return first, guess, taken, train.dense_forward(draft, feats, emb, pos, mask)


def _set_threshold(draft, frozen, seq, anchor, which: str) -> None:
    """``which``: "none" (every guess taken) or "median" (the median first-pass probability,
    so some guesses are taken and some slots stay MASK)."""
    import dataclasses

    if which == "median":
        with torch.no_grad():
            first = _two_passes(draft, frozen, seq, anchor)[0]
        sure = (first[1:] @ frozen.head.t()).softmax(-1).amax(-1)
        draft.config = dataclasses.replace(draft.config, refine_threshold=float(sure.median()))


def _larger_weights(draft) -> None:
    """Random weights large enough that the guesses vary by slot and by pass."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("threshold", ["none", "median"])
def test_a_refinement_pass_reruns_the_block_on_the_first_passs_guesses(tmp_path, threshold):
    """With ``refine_passes`` 1 the loss is the mean of both passes' and the predictions
    (hits) are the second pass's, whose block holds the first pass's greedy guesses (those
    sure enough, with a threshold)."""
    draft, frozen, seqs = _tiny_setup(tmp_path, refine_passes=1)
    assert draft.config.refine_passes == 1
    _larger_weights(draft)
    seq, anchor, b = seqs[0], 13, draft.config.block_size
    _set_threshold(draft, frozen, seq, anchor, threshold)
    with torch.no_grad():
        first, guess, taken, second = _two_passes(draft, frozen, seq, anchor)
    assert taken.all() if threshold == "none" else 0 < int(taken.sum()) < b - 1
    # the tokens after the anchor become the second pass's predictions (the block's input is
    # the anchor token and the context features only, so the passes do not change): all hits
    labels = (second[1:] @ frozen.head.t()).argmax(-1)
    assert labels.tolist() != guess.tolist()  # else this test could not tell the passes apart
    ids = seq.ids.clone()
    ids[anchor + 1 : anchor + b] = labels
    seq = train.Sequence(ids=ids, feats=seq.feats, prompt_len=seq.prompt_len)
    with torch.no_grad():
        loss, _, _, hits = train.sequence_loss(draft, frozen, seq, [anchor], 3.0)
    assert hits[0].tolist() == [1] * (b - 1)
    w = train.position_weights(b, 3.0)[1:]
    ce = [(w * torch.nn.functional.cross_entropy(h[1:] @ frozen.head.t(), labels,
                                                 reduction="none")).sum() / w.sum()
          for h in (first, second)]
    torch.testing.assert_close(loss, (ce[0] + ce[1]) / 2)


@pytest.mark.parametrize("threshold", ["none", "median"])
def test_served_refinement_equals_the_training_passes(tmp_path, threshold):
    """The proposer's block pass (paged, as served) runs the same refinement as training: its
    final states equal the dense second pass's, and its proposals are their argmax."""
    from attention.backends.base import AttentionBatch
    from attention.backends.torch_backend import TorchBackend
    from attention.groups import build_groups
    from engine.kv_pool import KVPool
    from engine.spec.dflash import DFlashProposer
    from models.llama import LlamaForCausalLM

    draft, frozen, seqs = _tiny_setup(tmp_path, refine_passes=1)
    _larger_weights(draft)
    draft.requires_grad_(False)
    target = LlamaForCausalLM(_tiny_target_config(), 256).requires_grad_(False)
    target.embed_tokens.weight.copy_(frozen.embed)  # tied: the frozen embedding and head
    seq, anchor, b = seqs[0], 13, draft.config.block_size
    proposer = DFlashProposer(draft, target, b - 1, "auto", 4, torch.device("cpu"))
    groups = build_groups(proposer.layer_specs(), torch.float32)
    pool = KVPool(list(groups.values()), num_blocks=16, layout="NHD", device=torch.device("cpu"))
    backend = TorchBackend()
    proposer.bind(pool, backend)
    kv = pool.layers(proposer.layer_names)
    pos = torch.arange(anchor, anchor + b)
    ids = torch.full((b,), 0)
    ids[0] = seq.ids[anchor]
    _set_threshold(draft, frozen, seq, anchor, threshold)
    with torch.no_grad():
        _, guess, taken, second = _two_passes(draft, frozen, seq, anchor)
    assert taken.all() if threshold == "none" else 0 < int(taken.sum()) < b - 1
    with torch.no_grad():
        draft.write_context(seq.feats.float()[:anchor], torch.arange(anchor), torch.arange(anchor), kv)
        batch = AttentionBatch(q_lens=(b,), kv_lens=(anchor + b,), block_tables=(tuple(range(16)),),
                               slot_mapping=pos, causal=False, block_size=4)
        served, = proposer._block_pass(ids, pos, backend.build_metadata(batch, torch.device("cpu")))
    assert len(set(guess.tolist())) > 1
    torch.testing.assert_close(served, second, atol=1e-5, rtol=1e-5)
    assert (served[1:] @ frozen.head.t()).argmax(-1).tolist() == \
        (second[1:] @ frozen.head.t()).argmax(-1).tolist()


def test_refine_passes_in_a_draft_config_are_checked():
    from models.dflash import DFlashConfig
    from models.dflash_init import draft_hf_config
    from models.hf_folder import ModelConfigError

    hf = draft_hf_config(_tiny_target_config(), num_layers=1, block_size=4, refine_passes=2)
    assert DFlashConfig.from_hf(hf).refine_passes == 2
    assert "refine_passes" not in draft_hf_config(_tiny_target_config(), 1, 4)["dflash_config"]
    for bad in (-1, 5, 1.5, True, "1"):
        hf["dflash_config"]["refine_passes"] = bad
        with pytest.raises(ModelConfigError, match="refine_passes"):
            DFlashConfig.from_hf(hf)
    hf = draft_hf_config(_tiny_target_config(), 1, 4, refine_passes=1, refine_threshold=0.6)
    assert DFlashConfig.from_hf(hf).refine_threshold == 0.6
    for bad in (-0.1, 1.0, True, "0.5", None):
        hf["dflash_config"]["refine_threshold"] = bad
        with pytest.raises(ModelConfigError, match="refine_threshold"):
            DFlashConfig.from_hf(hf)


def test_simulated_acceptance_counts_the_correct_prefix_plus_bonus():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    assert train.simulated_acceptance(hits) == (3 + 1 + 5) / 3


def test_draft_vocab_takes_frequent_response_tokens_then_lowest_ids():
    seqs = [train.Sequence(ids=torch.tensor([50, 51, 9, 9, 9, 7, 7, 40]), feats=torch.zeros(8, 2),
                           prompt_len=2)]
    # response 9 9 9 7 7 40: by frequency 9, 7, 40; the prompt's 50/51 do not count
    assert train.build_draft_vocab(seqs, 2, 64).tolist() == [7, 9]
    assert train.build_draft_vocab(seqs, 3, 64).tolist() == [7, 9, 40]
    assert train.build_draft_vocab(seqs, 5, 64).tolist() == [0, 1, 7, 9, 40]
    with pytest.raises(ValueError, match="draft-vocab"):
        train.build_draft_vocab(seqs, 65, 64)


def test_reduced_vocab_training_learns_and_counts_outside_labels_as_misses(tmp_path):
    draft, frozen, seqs = _tiny_setup(tmp_path)
    # the sequences use ids 3..9; leave out 9 so one label in seven can never be predicted
    vocab = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 20])
    small = frozen.restrict(vocab)
    assert small.head.shape == (10, 32) and small.t2d[20] == 9 and small.t2d[9] == -1
    rng = random.Random(0)
    anchors = [train.sample_anchors(s.prompt_len, s.ids.shape[0], 6, rng) for s in seqs]
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)

    def run(step: bool):
        total, correct, labels_9, hits_9 = 0.0, 0, 0, 0
        for s, a in zip(seqs, anchors):
            loss, c, n, hits = train.sequence_loss(draft, small, s, a, 3.0)
            if step:
                loss.backward()
            total += float(loss.detach())
            lab = train.block_labels(s.ids, a, draft.config.block_size)[:, 1:]
            labels_9 += int((lab == 9).sum())
            hits_9 += int(hits[lab == 9].sum())
        return total, labels_9, hits_9

    before, labels_9, _ = run(False)
    for _ in range(30):
        opt.zero_grad()
        run(True)
        opt.step()
    after, _, hits_9 = run(False)
    assert torch.isfinite(torch.tensor(after)) and after < 0.5 * before
    assert labels_9 > 0 and hits_9 == 0


def test_a_reduced_vocab_draft_saves_and_loads_its_d2t(tmp_path):
    from models.dflash import DFlashConfig, DFlashDraftModel
    from models.dflash_init import save_draft
    from models.hf_folder import iter_safetensors, load_hf_config

    draft, frozen, _ = _tiny_setup(tmp_path)
    vocab = torch.tensor([2, 3, 5, 8, 13, 21])
    hf = draft_config_with_vocab(len(vocab))
    draft.config = DFlashConfig.from_hf(hf)
    draft.set_d2t(vocab - torch.arange(6))
    save_draft(draft, hf, tmp_path / "out")
    back = DFlashDraftModel(DFlashConfig.from_hf(load_hf_config(tmp_path / "out")), 64)
    back.load_weights(iter_safetensors(tmp_path / "out"))
    assert back.draft_token_ids.tolist() == vocab.tolist()


def draft_config_with_vocab(n):
    from models.dflash_init import draft_hf_config

    target = _tiny_target_config()
    return draft_hf_config(target, num_layers=1, block_size=4, target_layer_ids=[1, 2],
                           draft_vocab_size=n)


def _tiny_run_args(tmp_path, out):
    """Command line of a training run on a tiny stored dataset (a random 4-layer target, 24
    sequences of 30-34 tokens with random features of taps 0-2)."""
    from tests.spec.helpers import save_target

    target = tmp_path / "target"
    if not target.exists():
        save_target(target, "llama", vocab=64, hidden=32, layers=4, seed=3)
    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        gen = torch.Generator().manual_seed(0)
        ids, lens, prompts = [], [], []
        for i in range(24):
            n = 30 + i % 5
            ids.append((torch.arange(n) * (1 + i % 3)) % 17 + 3)
            lens.append(n)
            prompts.append(6)
        all_ids = torch.cat(ids)
        feats = torch.randn(all_ids.shape[0], 3 * 32, generator=gen).to(torch.bfloat16)
        torch.save({"features": feats, "ids": all_ids, "lengths": torch.tensor(lens),
                    "prompt_lengths": torch.tensor(prompts)}, data / "features-0000.pt")
        (data / "features.json").write_text(
            '{"layers": [0, 1, 2], "dtype": "bfloat16", "shards": ["features-0000.pt"]}')
    return ["--data", str(data), "--out", str(out), "--model", str(target), "--layers", "1",
            "--taps", "1", "2", "--block-size", "4", "--ffn", "48", "--anchors", "4",
            "--batch", "4", "--val-sequences", "4", "--draft-vocab", "24", "--eval-every", "2",
            "--save-every", "1", "--max-positions", "64", "--head-dtype", "bfloat16"]


def test_train_end_to_end_with_resume_and_a_reduced_vocab(tmp_path):
    """``train()`` on a tiny stored dataset: writes a loadable draft with its d2t, the
    validation history, and a resumed run continues from its checkpoint instead of restarting."""
    from models.dflash import DFlashConfig, DFlashDraftModel
    from models.hf_folder import iter_safetensors, load_hf_config

    out = tmp_path / "run"
    argv = _tiny_run_args(tmp_path, out)
    first = train.train(train.parser().parse_args(argv + ["--epochs", "1"]))
    assert first["steps"] == 5  # 20 training sequences / batch 4
    resumed = train.train(train.parser().parse_args(argv + ["--epochs", "2", "--resume"]))
    assert resumed["steps"] == 10
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    # first run: steps 2, 4 and the end (5); the resumed run picks up at 5: 6, 8 and 10
    assert [h["step"] for h in history] == [2, 4, 5, 6, 8, 10]
    hf = load_hf_config(out / "draft")
    assert hf["draft_vocab_size"] == 24
    draft = DFlashDraftModel(DFlashConfig.from_hf(hf), 64)
    draft.load_weights(iter_safetensors(out / "draft"))
    vocab = draft.draft_token_ids.tolist()
    assert len(vocab) == 24 and set(range(3, 20)) <= set(vocab)  # every response token is in
    assert resumed["best_sim_accept_len"] == max(h["sim_accept_len"] for h in history)
    # a fixed step count instead of epochs, on a token budget: 3 steps over the first sequences
    fixed = train.train(train.parser().parse_args(
        [a if a != str(out) else str(tmp_path / "fixed") for a in argv]
        + ["--steps", "3", "--train-tokens", "100"]))
    assert fixed["steps"] == 3 and 100 <= fixed["train_response_tokens"] < 100 + 30
    # --eval-only scores the saved best draft on the same validation split, at any block size
    scored = train.train(train.parser().parse_args(
        argv + ["--init", str(out / "draft"), "--eval-only"]))
    assert scored["sim_accept_len"] == pytest.approx(resumed["best_sim_accept_len"], abs=1e-6)
    block3 = argv.copy()
    block3[argv.index("--block-size") + 1] = "3"
    shorter = train.train(train.parser().parse_args(
        block3 + ["--init", str(out / "draft"), "--eval-only"]))
    assert len(shorter["acc_per_pos"]) == 2 and (out / "eval-block3.json").is_file()
    assert 1.0 <= shorter["walk_accept_len"] <= 3.0
    with pytest.raises(ValueError, match="--init"):
        train.train(train.parser().parse_args(argv + ["--eval-only"]))
    with pytest.raises(ValueError, match="--distill"):
        train.train(train.parser().parse_args(argv + ["--steps", "1", "--distill", "1.5"]))


def test_the_head_dtype_is_measured_and_keeps_the_heads_values(tmp_path, capsys):
    """``--head-dtype auto`` times both dtypes at the run's shapes and trains with the faster;
    float32 holds the bfloat16 head exactly, so either way the draft scores the same weights."""
    head = torch.randn(24, 16).to(torch.bfloat16)
    choice, seconds = train.fastest_head_dtype(head, rows=12, rounds=2)
    assert choice in (torch.bfloat16, torch.float32) and set(seconds) == {"bfloat16", "float32"}
    assert choice == getattr(torch, min(seconds, key=seconds.get)) and min(seconds.values()) > 0
    frozen = train.Frozen(embed=head.float(), head=head).with_head_dtype(torch.float32)
    assert frozen.head.dtype == torch.float32 and torch.equal(frozen.head, head.float())
    argv = _tiny_run_args(tmp_path, tmp_path / "run")
    argv[argv.index("--head-dtype") + 1] = "auto"
    done = train.train(train.parser().parse_args(argv + ["--steps", "2"]))
    assert done["steps"] == 2 and math.isfinite(done["loss"])
    assert re.search(r"head dtype auto: (bfloat16|float32) \(a 12-row product and its gradient: "
                     r"bfloat16 [0-9.]+ ms, float32 [0-9.]+ ms\)", capsys.readouterr().out)
    pinned = train.parser().parse_args(argv[:-1] + ["float32"])
    assert train.head_dtype(pinned, frozen) == torch.float32


def test_weight_average_follows_the_decay_and_swaps_back():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    avg = train.WeightAverage([w], 0.75)
    with torch.no_grad():
        w.copy_(torch.tensor([5.0, 6.0]))
    avg.update()  # 0.75 * start + 0.25 * now
    assert avg.shadow[0].tolist() == [2.0, 3.0]
    avg.swap()
    assert w.tolist() == [2.0, 3.0] and avg.shadow[0].tolist() == [5.0, 6.0]
    avg.swap()
    assert w.tolist() == [5.0, 6.0] and avg.shadow[0].tolist() == [2.0, 3.0]
    assert w.dtype == torch.bfloat16 and avg.shadow[0].dtype == torch.float32
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="--ema"):
            train.WeightAverage([w], bad)


def test_ema_run_saves_the_average_and_the_trained_weights_and_resumes_exactly(tmp_path):
    """``--ema``: ``out/draft`` holds the validated average, ``out/draft-raw`` the last trained
    weights; validation logs both; a run stopped and resumed ends with the same average as one
    that ran through."""
    from models.hf_folder import iter_safetensors

    def weights(folder):
        return dict(iter_safetensors(folder))

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ema = ["--ema", "0.5", "--lr", "1e-2"]
    done = train.train(train.parser().parse_args(_tiny_run_args(tmp_path, whole) + ema
                                                 + ["--steps", "4"]))
    history = [json.loads(line) for line in (whole / "history.jsonl").read_text().splitlines()]
    assert all("raw_sim_accept_len" in h and "raw_loss" in h for h in history)
    assert done["best_sim_accept_len"] == max(h["sim_accept_len"] for h in history)
    avg, last = weights(whole / "draft"), weights(whole / "draft-raw")
    assert avg.keys() == last.keys()
    assert any(not torch.equal(avg[k], last[k]) for k in avg if avg[k].is_floating_point())
    # the final validation's figures for the trained weights are those of draft-raw
    scored = train.train(train.parser().parse_args(
        _tiny_run_args(tmp_path, tmp_path / "score") + ["--init", str(whole / "draft-raw"),
                                                         "--eval-only"]))
    assert scored["sim_accept_len"] == pytest.approx(history[-1]["raw_sim_accept_len"], abs=1e-6)
    argv = _tiny_run_args(tmp_path, parts) + ema
    with pytest.raises(SystemExit):  # stop after step 2, as a killed run would
        _stop_after(train, 2, lambda: train.train(train.parser().parse_args(argv + ["--steps", "4"])))
    train.train(train.parser().parse_args(argv + ["--steps", "4", "--resume"]))
    state_whole = torch.load(whole / "train_state.pt")["ema"]["shadow"]
    state_parts = torch.load(parts / "train_state.pt")["ema"]["shadow"]
    assert all(torch.equal(a, b) for a, b in zip(state_whole, state_parts))
    with pytest.raises(ValueError, match="--ema"):
        train.train(train.parser().parse_args(argv + ["--steps", "4", "--ema", "1.5"]))
    with pytest.raises(ValueError, match="same data"):  # the saved shuffle fits only its data
        train.train(train.parser().parse_args(argv + ["--steps", "6", "--resume",
                                                      "--max-sequences", "20"]))


def _stop_after(module, steps: int, run):
    """Run ``run()`` with the optimizer's step count limited: the ``steps + 1``-th call to
    ``WeightAverage.update`` raises SystemExit (after the checkpoint of step ``steps``)."""
    calls = {"n": 0}
    original = module.WeightAverage.update

    def update(self):
        calls["n"] += 1
        if calls["n"] > steps:
            raise SystemExit(1)
        original(self)

    module.WeightAverage.update = update
    try:
        run()
    finally:
        module.WeightAverage.update = original


def test_token_budgets_share_one_validation_set_and_nest():
    """Data-size sweeps: every ``train_tokens`` budget validates on the same sequences, never
    trains on them, and a larger budget's training set extends the smaller one's."""
    seqs = [train.Sequence(torch.arange(10 + i), torch.zeros(10 + i, 4), 4) for i in range(50)]
    val_all, train_all = train.split_sequences(seqs, 5, seed=7)
    assert len(val_all) == 5 and len(train_all) == 45
    small_val, small = train.split_sequences(seqs, 5, seed=7, train_tokens=100)
    big_val, big = train.split_sequences(seqs, 5, seed=7, train_tokens=400)
    assert [id(s) for s in small_val] == [id(s) for s in big_val] == [id(s) for s in val_all]
    assert not {id(s) for s in big} & {id(s) for s in val_all}
    assert [id(s) for s in big[: len(small)]] == [id(s) for s in small]
    for part, budget in ((small, 100), (big, 400)):
        tokens = [s.ids.shape[0] - s.prompt_len for s in part]
        assert sum(tokens) >= budget > sum(tokens[:-1])  # the first sequences up to the budget
    with pytest.raises(ValueError, match="only"):
        train.split_sequences(seqs, 5, seed=7, train_tokens=10**6)


def test_load_sequences_cuts_the_taps_out_of_a_memory_mapped_shard(tmp_path):
    """Stored layers [0, 1, 2] of hidden size 4; taps [2, 0] are those columns in tap order, per
    sequence, and taps equal to the stored layers give the rows as stored."""
    feats = torch.arange(9 * 12, dtype=torch.float32).view(9, 12).to(torch.float16)
    torch.save({"features": feats, "ids": torch.arange(9), "lengths": torch.tensor([4, 5]),
                "prompt_lengths": torch.tensor([1, 2])}, tmp_path / "features-0000.pt")
    (tmp_path / "features.json").write_text(
        '{"layers": [0, 1, 2], "dtype": "float16", "shards": ["features-0000.pt"]}')
    first, second = train.load_sequences(tmp_path, [2, 0])
    assert second.ids.tolist() == [4, 5, 6, 7, 8] and second.prompt_len == 2
    assert torch.equal(second.features(), torch.cat([feats[4:, 8:12], feats[4:, 0:4]], 1).float())
    whole = train.load_sequences(tmp_path, [0, 1, 2])[0]
    assert whole.cols is None and torch.equal(whole.features(), feats[:4].float())


def test_init_continues_from_a_saved_draft_with_this_runs_vocabulary(tmp_path):
    """``--init``: every weight (and the mask embedding, still trainable) comes from the saved
    draft; the vocabulary mapping is this run's; a draft of another shape or taps is refused."""
    from types import SimpleNamespace

    from models.dflash_init import save_draft

    draft, frozen, _ = _tiny_setup(tmp_path)
    args = SimpleNamespace(layers=1, block_size=4, taps=[1, 2], ffn=48, max_positions=64, seed=5,
                           dflash2=False, refine=0, refine_threshold=0.0)
    frozen_small = frozen.restrict(torch.tensor([0, 2, 3, 5, 7, 11, 13, 17]))
    saved, hf = train.build_draft(args, _tiny_target_config(), frozen_small)
    with torch.no_grad():  # a trained mask embedding, unlike a fresh draft's (the mean row)
        saved.mask_embedding.add_(torch.randn_like(saved.mask_embedding))
    save_draft(saved, hf, tmp_path / "saved", dtype=torch.float32)
    assert (tmp_path / "saved" / "mask_embedding.safetensors").is_file()

    other_vocab = frozen.restrict(torch.tensor([1, 2, 4, 6, 8, 9, 10, 12]))
    fresh, hf2 = train.build_draft(SimpleNamespace(**{**vars(args), "seed": 9}),
                                   _tiny_target_config(), other_vocab)
    train.init_from(fresh, hf2, tmp_path / "saved")
    want = {k: v for k, v in saved.state_dict().items() if k != "d2t"}
    got = fresh.state_dict()
    assert want.keys() <= got.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert fresh.draft_token_ids.tolist() == [1, 2, 4, 6, 8, 9, 10, 12]
    assert fresh.mask_embedding.requires_grad
    # --vocab-from: the saved draft's own vocabulary instead of this run's
    assert train.saved_draft_vocab(tmp_path / "saved").tolist() == [0, 2, 3, 5, 7, 11, 13, 17]
    full, hf_full = train.build_draft(args, _tiny_target_config(), frozen)
    save_draft(full, hf_full, tmp_path / "full", dtype=torch.float32)
    with pytest.raises(ValueError, match="no reduced vocabulary"):
        train.saved_draft_vocab(tmp_path / "full")

    wrong, hf3 = train.build_draft(SimpleNamespace(**{**vars(args), "taps": [0]}),
                                   _tiny_target_config(), other_vocab)
    with pytest.raises(ValueError, match="at least one saved tap"):
        train.init_from(wrong, hf3, tmp_path / "saved")


def test_init_takes_another_block_size_and_a_subset_of_the_taps(tmp_path):
    """``--init`` into a run with a longer block loads every weight as saved (none depends on
    the block size); into a run with fewer taps, ``fc`` keeps the kept taps' columns, so the
    new draft's context feature equals the saved one's with the dropped tap's states at zero."""
    from types import SimpleNamespace

    from models.dflash_init import save_draft

    _, frozen, _ = _tiny_setup(tmp_path)
    args = SimpleNamespace(layers=1, block_size=4, taps=[0, 1, 2], ffn=48, max_positions=64,
                           seed=5, dflash2=False, refine=0, refine_threshold=0.0)
    saved, hf = train.build_draft(args, _tiny_target_config(), frozen)
    save_draft(saved, hf, tmp_path / "saved", dtype=torch.float32)

    longer, hf2 = train.build_draft(SimpleNamespace(**{**vars(args), "block_size": 8, "seed": 9}),
                                    _tiny_target_config(), frozen)
    train.init_from(longer, hf2, tmp_path / "saved")
    assert longer.config.block_size == 8
    got = longer.state_dict()
    for k, v in saved.state_dict().items():
        assert torch.equal(got[k], v), k

    fewer, hf3 = train.build_draft(SimpleNamespace(**{**vars(args), "taps": [0, 2], "seed": 9}),
                                   _tiny_target_config(), frozen)
    train.init_from(fewer, hf3, tmp_path / "saved")
    width = hf["hidden_size"]
    x0, x2 = torch.randn(3, width), torch.randn(3, width)
    with torch.no_grad():
        full = saved.fc(torch.cat([x0, torch.zeros(3, width), x2], dim=-1))
        kept = fewer.fc(torch.cat([x0, x2], dim=-1))
    torch.testing.assert_close(kept, full)
    got = fewer.state_dict()
    for k, v in saved.state_dict().items():
        if k != "fc.weight":
            assert torch.equal(got[k], v), k


def test_init_adds_taps_that_start_at_zero(tmp_path):
    """``--init`` into a run with a tap the saved draft lacks: its ``fc`` columns start at zero,
    the saved taps keep theirs (in this run's tap order), so the new draft's context feature
    equals the saved one's whatever the new tap's states are."""
    from types import SimpleNamespace

    from models.dflash_init import save_draft

    _, frozen, _ = _tiny_setup(tmp_path)
    args = SimpleNamespace(layers=1, block_size=4, taps=[2, 0], ffn=48, max_positions=64,
                           seed=5, dflash2=False, refine=0, refine_threshold=0.0)
    saved, hf = train.build_draft(args, _tiny_target_config(), frozen)
    save_draft(saved, hf, tmp_path / "saved", dtype=torch.float32)
    more, hf2 = train.build_draft(SimpleNamespace(**{**vars(args), "taps": [0, 1, 2], "seed": 9}),
                                  _tiny_target_config(), frozen)
    train.init_from(more, hf2, tmp_path / "saved")
    width = hf["hidden_size"]
    x0, x1, x2 = (torch.randn(3, width) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(more.fc(torch.cat([x0, x1, x2], dim=-1)),
                                   saved.fc(torch.cat([x2, x0], dim=-1)))
        assert more.fc.weight[:, width:2 * width].abs().max() == 0
    got = more.state_dict()
    for k, v in saved.state_dict().items():
        if k != "fc.weight":
            assert torch.equal(got[k], v), k


def test_init_grows_a_deeper_draft_that_starts_as_the_saved_one(tmp_path):
    """``--init`` into a run with more layers: the extra layer is a copy of the last saved one
    with zeroed output projections, so the 2-layer draft's loss equals the 1-layer draft's
    before training, and its gradients reach the new layer; fewer layers are refused."""
    from types import SimpleNamespace

    from models.dflash_init import save_draft

    _, frozen, seqs = _tiny_setup(tmp_path)
    args = SimpleNamespace(layers=1, block_size=4, taps=[1, 2], ffn=48, max_positions=64, seed=5,
                           dflash2=False, refine=0, refine_threshold=0.0)
    saved, hf = train.build_draft(args, _tiny_target_config(), frozen)
    save_draft(saved, hf, tmp_path / "saved", dtype=torch.float32)
    deep, hf2 = train.build_draft(SimpleNamespace(**{**vars(args), "layers": 2, "seed": 9}),
                                  _tiny_target_config(), frozen)
    train.init_from(deep, hf2, tmp_path / "saved")

    got, want = deep.state_dict(), saved.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for k, v in want.items():
        if k.startswith("layers.0."):
            new = got["layers.1." + k[len("layers.0."):]]
            zero = k.endswith(("o_proj.weight", "down_proj.weight"))
            assert torch.equal(new, torch.zeros_like(v) if zero else v), k
    anchors = [3, 11, 20]
    one = train.sequence_loss(saved, frozen, seqs[0], anchors, 3.0)[0]
    two = train.sequence_loss(deep, frozen, seqs[0], anchors, 3.0)[0]
    assert torch.allclose(one, two, atol=1e-6)
    two.backward()
    grads = {n: p.grad for n, p in deep.named_parameters() if n.startswith("layers.1.")}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "o_proj" in n)

    save_draft(deep, hf2, tmp_path / "deep", dtype=torch.float32)
    with pytest.raises(ValueError, match="layers"):
        train.init_from(saved, hf, tmp_path / "deep")


def test_several_folders_validate_on_the_newest_and_train_on_all():
    """``--data OLD NEW``: validation is drawn from NEW only (new to a draft that trained on
    OLD), and is the same draw as NEW alone would give; everything else trains."""
    old = [train.Sequence(torch.arange(10), torch.zeros(10, 4), 4) for _ in range(30)]
    new = [train.Sequence(torch.arange(12), torch.zeros(12, 4), 4) for _ in range(50)]
    val, train_seqs = train.split_sequences(old + new, 5, seed=7, val_from=len(old))
    alone_val, alone_train = train.split_sequences(new, 5, seed=7)
    assert [id(s) for s in val] == [id(s) for s in alone_val]
    assert [id(s) for s in train_seqs] == [id(s) for s in old] + [id(s) for s in alone_train]


def _hf_states(target: Path, seqs: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Per sequence: transformers' outputs of every decoder layer and its logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            res = model(ids[None], output_hidden_states=True)
            # hidden_states[i + 1] is layer i's output (the last one is final-normed instead)
            out.append(([h[0] for h in res.hidden_states[1:-1]], res.logits[0]))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_teacher_recomputes_the_targets_logits_from_the_deepest_tap(tmp_path, arch):
    """From a stored layer's output the teacher runs the layers above it, the final norm and
    the head: transformers' logits at the asked positions, restricted to a draft vocabulary."""
    from tests.spec.helpers import save_target

    target = save_target(tmp_path / "t", arch, vocab=64, hidden=32, layers=4, seed=2)
    ids = torch.randint(0, 64, (21,), generator=torch.Generator().manual_seed(0))
    (states, logits), = _hf_states(target, [ids])
    teacher = train.Teacher(str(target), [0, 1], dtype=torch.float32)  # runs layers 2 and 3
    feats = torch.cat([states[0], states[1]], dim=1)
    rows = torch.tensor([0, 5, 6, 20])
    torch.testing.assert_close(teacher.logits(feats, rows), logits[rows], atol=1e-4, rtol=1e-4)
    vocab = torch.tensor([3, 9, 40])
    torch.testing.assert_close(teacher.logits(feats, rows, teacher.head[vocab]),
                               logits[rows][:, vocab], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="layers 0..3"):
        train.Teacher(str(target), [1, 4])


def test_distillation_pulls_the_draft_towards_the_targets_distribution(tmp_path):
    """``--distill 1``: the loss is the cross-entropy against the teacher's distribution, so
    training lowers the KL divergence from the target's next-token distribution at every
    block slot; ``--distill 0`` leaves the teacher out (the hard-label loss, as before)."""
    from types import SimpleNamespace

    from tests.spec.helpers import save_target

    target = save_target(tmp_path / "t", "llama", vocab=64, hidden=32, layers=4, seed=4, init=0.1)
    frozen, cfg = train.load_frozen(str(target))
    frozen = train.Frozen(embed=frozen.embed, head=frozen.head.float())  # bf16 in real runs
    gen = torch.Generator().manual_seed(1)
    raw = [torch.randint(3, 64, (30,), generator=gen) for _ in range(4)]
    seqs = [train.Sequence(ids, torch.cat(states[1:3], dim=1).half(), 4)
            for ids, (states, _) in zip(raw, _hf_states(target, raw))]
    teacher = train.Teacher(str(target), [1, 2], dtype=torch.float32)
    args = SimpleNamespace(layers=1, block_size=4, taps=[1, 2], ffn=48, max_positions=64, seed=0,
                           dflash2=False, refine=0, refine_threshold=0.0)
    draft, _ = train.build_draft(args, cfg, frozen)
    rng = random.Random(0)
    anchors = [train.sample_anchors(s.prompt_len, s.ids.shape[0], 6, rng) for s in seqs]

    def kl_now() -> float:
        """The soft cross-entropy: KL(target || draft) plus the target's own entropy."""
        with torch.no_grad():
            soft = sum(float(train.sequence_loss(draft, frozen, s, a, 3.0, teacher=teacher,
                                                 distill=1.0)[0]) for s, a in zip(seqs, anchors))
            hard = sum(float(train.sequence_loss(draft, frozen, s, a, 3.0, teacher=teacher,
                                                 distill=0.0)[0]) for s, a in zip(seqs, anchors))
            plain = sum(float(train.sequence_loss(draft, frozen, s, a, 3.0)[0])
                        for s, a in zip(seqs, anchors))
        assert hard == pytest.approx(plain)  # distill 0: the teacher takes no part
        return soft

    before = kl_now()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):
        opt.zero_grad()
        for s, a in zip(seqs, anchors):
            train.sequence_loss(draft, frozen, s, a, 3.0, teacher=teacher, distill=1.0)[0].backward()
        opt.step()
    entropy = 0.0  # the floor of the soft cross-entropy: the teacher's own entropy
    with torch.no_grad():
        for s, a in zip(seqs, anchors):
            rows = (torch.tensor(a)[:, None] + torch.arange(3)[None, :]).reshape(-1)
            w = train.position_weights(4, 3.0)[1:].repeat(len(a))
            inside = rows + 1 < s.ids.shape[0]  # slots whose label is in the sequence
            rows, w = rows[inside], w[inside]
            p = teacher.logits(s.features(), rows).softmax(-1)
            entropy += float((w * -(p * p.log()).sum(-1)).sum() / w.sum())
    after = kl_now()
    assert after - entropy < 0.5 * (before - entropy)


def test_served_walk_steps_from_the_first_response_token_by_correct_prefix_plus_one(monkeypatch):
    """The walk starts at the first response token and moves by each block's correct draft
    prefix plus the target's token; only the anchors it stops at count, however the hits are
    computed in chunks."""
    b = 4
    # correct draft prefix of the block anchored at each position (prompt 3, sequence 14)
    prefix = {3: 2, 4: 3, 5: 3, 6: 0, 7: 1, 8: 0, 9: 3, 10: 2, 11: 0, 12: 1}

    def fake_loss(draft, frozen, seq, anchors, gamma):
        hits = torch.tensor([[1] * prefix[a] + [0] * (b - 1 - prefix[a]) for a in anchors])
        return None, None, None, hits

    monkeypatch.setattr(train, "sequence_loss", fake_loss)
    seq = train.Sequence(ids=torch.arange(14), feats=torch.zeros(14, 2), prompt_len=3)
    # anchors 3 (+3) -> 6 (+1) -> 7 (+2) -> 9 (+4) -> 13: the end
    assert train.served_walk(None, None, seq, chunk=3) == (10, 4)
    assert train.served_walk(None, None, seq, chunk=64) == (10, 4)
    short = train.Sequence(ids=torch.arange(4), feats=torch.zeros(4, 2), prompt_len=3)
    assert train.served_walk(None, None, short) == (0, 0)  # the prefill made the only token


@pytest.mark.parametrize("reduced", [False, True])
def test_slot_ranks_are_zero_exactly_where_the_greedy_draft_is_right(tmp_path, reduced):
    """Rank 0 at a slot is a hit of the training loss's greedy prediction; a label past the end
    or outside the draft vocabulary ranks past every scored token; other ranks count the
    scores strictly above the label's."""
    draft, frozen, seqs = _tiny_setup(tmp_path)
    if reduced:
        vocab = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 20])  # label 9 is outside
        frozen = frozen.restrict(vocab)
    seq = seqs[0]
    ranks = train.slot_ranks(draft, frozen, seq, chunk=5)
    again, probs = train.slot_ranks(draft, frozen, seq, chunk=5, width=3)
    assert torch.equal(again, ranks)
    anchors = list(range(seq.prompt_len, seq.ids.shape[0] - 1))
    assert ranks.shape == (len(anchors), draft.config.block_size - 1)
    hits = train.sequence_loss(draft, frozen, seq, anchors, 1.0)[3]
    assert torch.equal(ranks == 0, hits.bool())
    never = frozen.head.shape[0]
    assert (ranks[-1, 1:] == never).all()  # the last anchor has one label left
    if reduced:
        labels = train.block_labels(seq.ids, anchors, draft.config.block_size)[:, 1:]
        assert (ranks[labels == 9] == never).all() and (labels == 9).any()
    feats, emb, pos, mask, lab = train.block_inputs(draft, frozen, seq, anchors[:3])
    h = train.dense_forward(draft, feats, emb.reshape(-1, emb.shape[-1]), pos, mask)
    scores = (h.view(3, draft.config.block_size, -1)[:, 1:] @ frozen.head.t()).float()
    # the three largest probabilities of each slot, best first
    top = scores.softmax(-1).sort(-1, descending=True).values[..., :3]
    assert torch.allclose(probs[:3], top, atol=1e-6) and (probs[:, :, :-1] >= probs[:, :, 1:]).all()
    target = lab if frozen.t2d is None else frozen.t2d[lab]
    checked = 0
    for i in range(3):
        for j in range(draft.config.block_size - 1):
            if lab[i, j] != -100 and target[i, j] >= 0:
                assert ranks[i, j] == int((scores[i, j] > scores[i, j, target[i, j]]).sum())
                checked += 1
    assert checked >= 6 and (ranks[:3] > 0).any()  # most of the 9 slots, some misses among them
