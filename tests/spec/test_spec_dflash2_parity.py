"""Our paged DFlash2 draft against the reference ``dflash.model.DFlash2DraftModel``: config,
weights (both codebook spellings), hidden states, logits, greedy and sampled selection, and
the cached multi-step loop (the block convolutions need no cache of their own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attention.backends.base import AttentionBatch
from attention.backends.torch_backend import TorchBackend
from attention.groups import LayerKVSpec, build_groups
from engine.kv_pool import KVPool
from engine.runner import slots_for
from models.dflash2 import DFlash2Config, DFlash2DraftModel, draft_config, is_dflash2
from models.hf_folder import iter_safetensors, load_hf_config

from .helpers import draft_hf_config

H, TAPS, BS, B, V = 64, 3, 4, 5, 256  # hidden, taps, KV block size, query block, vocab
CPU = torch.device("cpu")
TOL = {"rtol": 1e-4, "atol": 1e-4}
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


def save_dflash2(folder: Path, *, seed: int = 1, init: float = 0.1, conv_init: float = 0.2,
                 selector_init: float = 0.5, dflash2: dict | None = None, **cfg_kwargs):
    """A random DFlash2 draft written by the reference package's ``save_pretrained``; every
    parameter is random (norms around 1). Returns the reference model (float32, eval)."""
    from dflash.model import DFlash2DraftModel as Ref

    cfg = draft_hf_config(init=init, **cfg_kwargs)
    cfg.dflash_config.update(dflash2 or DFLASH2)
    torch.manual_seed(seed)
    ref = Ref(cfg).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "_conv." in name:
                p.copy_(conv_init * torch.randn_like(p))
            elif name.startswith("candidate_selector."):
                p.copy_(selector_init * torch.randn_like(p))
            else:
                p.copy_(init * torch.randn_like(p))
    ref.save_pretrained(folder, safe_serialization=True)
    return ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash2-parity")
    ref = save_dflash2(folder, seed=9, layers=2, heads=4, kv_heads=2, head_dim=16, block_size=8,
                       target_layer_ids=(1, 3, 4), num_target_layers=6, rope_theta=1e4)
    hf = load_hf_config(folder)
    ours = DFlash2DraftModel(DFlash2Config.from_hf(hf), max_positions=128).float().eval()
    ours.load_weights(iter_safetensors(folder))
    return ref, ours, folder


def _pool(ours, layout, num_blocks=24):
    c = ours.config
    names = [f"draft.layers.{i}" for i in range(c.num_layers)]
    specs = [LayerKVSpec(n, "draft", c.num_kv_heads, c.head_dim, "auto", BS) for n in names]
    pool = KVPool(list(build_groups(specs, torch.float32).values()), num_blocks, layout, CPU)
    return pool.layers(names)


def _inputs(seed, c):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c, TAPS * H, generator=g), torch.randn(B, H, generator=g)


def _write(ours, kvs, table, ctx, start, end):
    with torch.inference_mode():
        ours.write_context(ctx[start:end], torch.arange(start, end),
                           slots_for(table, start, end, BS), kvs)


def _ours_forward(ours, kvs, reqs):
    """reqs: list of (table, context length, block embeds), context already written."""
    slots = torch.cat([slots_for(t, c, c + B, BS) for t, c, _ in reqs])
    batch = AttentionBatch(q_lens=(B,) * len(reqs), kv_lens=tuple(c + B for _, c, _ in reqs),
                           block_tables=tuple(tuple(t) for t, _, _ in reqs),
                           slot_mapping=slots, causal=False, block_size=BS)
    meta = TorchBackend().build_metadata(batch, CPU)
    positions = torch.cat([torch.arange(c, c + B) for _, c, _ in reqs])
    with torch.inference_mode():
        return ours(torch.cat([e for _, _, e in reqs]), positions, meta, kvs, block_len=B)


def _ref_forward(ref, ctx, block):
    c = ctx.shape[0]
    with torch.inference_mode():
        return ref(position_ids=torch.arange(c + B)[None], noise_embedding=block[None],
                   target_hidden=ctx[None])[0]


def _head(seed=1):
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed)) * 0.5


def _head_module(head):
    out = torch.nn.Linear(H, V, bias=False)  # (initialising it draws random numbers)
    out.weight.data.copy_(head)
    return out


def _ref_propose(ref, hidden, anchors, head, temperature=0.0):
    out = head if isinstance(head, torch.nn.Module) else _head_module(head)
    with torch.inference_mode():
        return ref.propose(hidden, anchors, out, temperature)


def test_config_detected_and_parsed(models):
    ref, ours, folder = models
    hf = load_hf_config(folder)
    assert hf["architectures"] == ["DFlash2DraftModel"] and is_dflash2(hf)
    c = draft_config(hf)
    assert isinstance(c, DFlash2Config) and c == ours.config
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (3, 16, 8, 6)
    assert c.target_layer_ids == tuple(ref.target_layer_ids) and c.block_size == 8
    assert c.vocab_size == V and c.conv_groups == 4
    # top-level keys (not under dflash_config) are read too, as the reference does
    flat = {**hf, **hf["dflash_config"]}
    del flat["dflash_config"]
    flat["target_layer_ids"] = list(c.target_layer_ids)
    assert DFlash2Config.from_hf(flat).selector_top_k == 6


def test_every_reference_weight_is_loaded(models):
    ref, ours, _ = models
    mine = dict(ours.named_parameters())
    for name, p in ref.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                          "up_proj.weight")):
            continue  # fused in ours; covered by the forward parity
        assert torch.equal(mine[name], p), name


def test_bare_codebook_keys_load_like_the_reference(models, tmp_path):
    """The reference's from_pretrained maps ``candidate_selector.*_codebook`` to ``.weight``;
    a checkpoint stored with the bare names loads the same in both."""
    from dflash.model import DFlash2DraftModel as Ref
    from safetensors.torch import load_file, save_file

    ref, ours, folder = models
    weights = load_file(str(folder / "model.safetensors"))
    bare = {k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in weights.items()}
    assert "candidate_selector.predecessor_codebook" in bare
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(bare, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    back = DFlash2DraftModel(ours.config, 64)
    back.load_weights(iter_safetensors(tmp_path))
    ref_back = Ref.from_pretrained(tmp_path, dtype=torch.float32)
    for name in ("predecessor_codebook", "successor_codebook"):
        want = getattr(ref.candidate_selector, name).weight
        assert torch.equal(getattr(back.candidate_selector, name).weight, want)
        assert torch.equal(getattr(ref_back.candidate_selector, name).weight, want)


def test_missing_selector_weight_is_refused(models, tmp_path):
    from safetensors.torch import load_file, save_file

    from models.llama import WeightLoadError

    _, ours, folder = models
    weights = load_file(str(folder / "model.safetensors"))
    del weights["layers.1.mlp_conv.base_kernel"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="mlp_conv.base_kernel"):
        DFlash2DraftModel(ours.config, 64).load_weights(iter_safetensors(tmp_path))


def test_bad_dflash2_config_is_refused(models):
    from models.hf_folder import ModelConfigError

    _, _, folder = models
    hf = load_hf_config(folder)
    for key, value, text in (("conv_group_size", 7, "divide"), ("selector_top_k", 0, "selector_top_k"),
                             ("selector_top_k", V + 1, "selector_top_k")):
        bad = json.loads(json.dumps(hf))
        bad["dflash_config"][key] = value
        with pytest.raises(ModelConfigError, match=text):
            DFlash2Config.from_hf(bad)
    bad = json.loads(json.dumps(hf))
    del bad["dflash_config"]["selector_rank"]
    with pytest.raises(ModelConfigError, match="selector_rank"):
        DFlash2Config.from_hf(bad)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("c", [1, 13])
def test_hidden_logits_and_greedy_proposals_match_reference(models, layout, c):
    ref, ours, _ = models
    kvs = _pool(ours, layout)
    table = [7, 2, 11, 4, 0, 9]
    ctx, block = _inputs(100 + c, c)
    _write(ours, kvs, table, ctx, 0, c)
    got = _ours_forward(ours, kvs, [(table, c, block)])
    want = _ref_forward(ref, ctx, block)
    torch.testing.assert_close(got, want, **TOL)
    head = _head()
    torch.testing.assert_close(got[1:] @ head.T, want[1:] @ head.T, **TOL)
    anchor = torch.tensor([17])
    tokens, _, _ = _ref_propose(ref, want[None, 1:], anchor, head)
    with torch.inference_mode():
        sel = ours.candidate_selector.select(got[None, 1:], got[None, 1:] @ head.T, anchor)
    assert sel.tokens.tolist() == tokens.tolist()
    # the selector matters here: its choice differs from the per-position argmax somewhere
    if c == 13:
        assert sel.tokens.tolist() != (got[None, 1:] @ head.T).argmax(-1).tolist()


def test_batched_requests_match_reference_individually(models):
    ref, ours, _ = models
    kvs = _pool(ours, "HND")
    reqs = []
    for seed, (table, c) in enumerate([([3, 8, 1, 14, 15], 13), ([5, 10, 16], 6), ([12, 17], 1)]):
        ctx, block = _inputs(seed, c)
        _write(ours, kvs, table, ctx, 0, c)
        reqs.append((table, c, block, ctx))
    got = _ours_forward(ours, kvs, [(t, c, b) for t, c, b, _ in reqs])
    head = _head(3)
    anchors = torch.tensor([5, 77, 200])
    wants = [_ref_forward(ref, ctx, block) for _, _, block, ctx in reqs]
    for i, want in enumerate(wants):
        torch.testing.assert_close(got[i * B: (i + 1) * B], want, **TOL)
    hidden = got.view(3, B, H)[:, 1:]
    want_tokens, _, _ = _ref_propose(ref, torch.stack(wants)[:, 1:], anchors, head)
    with torch.inference_mode():
        sel = ours.candidate_selector.select(hidden, hidden @ head.T, anchors)
    assert sel.tokens.tolist() == want_tokens.tolist()


def test_sampled_selection_draws_from_the_reference_q(models, monkeypatch):
    """With the same random stream and candidate order, the sampled path and its q match the
    reference's (q compared per token, as distributions over the vocabulary)."""
    ref, ours, _ = models
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, B - 1, H, generator=g)
    head = _head(4)
    anchors = torch.tensor([1, 2, 3, 4])
    topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, k, dim=-1, sorted=True: topk(x, k, dim=dim))
    module = _head_module(head)
    torch.manual_seed(123)
    tokens, cands, q = _ref_propose(ref, hidden, anchors, module, temperature=0.8)
    monkeypatch.setattr(torch, "topk", topk)
    torch.manual_seed(123)
    with torch.inference_mode():
        sel = ours.candidate_selector.select(hidden, hidden @ head.T, anchors,
                                             temperature=torch.full((4,), 0.8))
    assert sel.tokens.tolist() == tokens.tolist()

    def dense(c, p):
        return torch.zeros(*c.shape[:-1], V).scatter(-1, c, p.float())

    torch.testing.assert_close(dense(sel.candidates, sel.q), dense(cands, q), **TOL)
    torch.testing.assert_close(sel.q.sum(-1), torch.ones(4, B - 1))


def test_mixed_greedy_and_sampled_rows(models):
    _, ours, _ = models
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(3, B - 1, H, generator=g)
    head = _head(5)
    anchors = torch.tensor([9, 10, 11])
    with torch.inference_mode():
        greedy = ours.candidate_selector.select(hidden, hidden @ head.T, anchors)
        mixed = ours.candidate_selector.select(hidden, hidden @ head.T, anchors,
                                               temperature=torch.tensor([0.0, 1.0, 0.0]),
                                               generator=torch.Generator().manual_seed(0))
    assert mixed.tokens[[0, 2]].tolist() == greedy.tokens[[0, 2]].tolist()
    assert torch.equal(mixed.q[0].max(-1).values, torch.ones(B - 1))  # one-hot rows


def test_cached_loop_matches_reference(models):
    """Two steps as in the reference's cached loop: the block convolutions see only their own
    block, so writing only the new context and overwriting the block slots reproduces it."""
    from dflash.model import _crop_to, _make_cache

    ref, ours, _ = models
    c1, c2 = 6, 9
    table = [4, 0, 7, 2]
    ctx, block1 = _inputs(11, c2)
    block2 = torch.randn(B, H, generator=torch.Generator().manual_seed(12))
    kvs = _pool(ours, "NHD")
    cache = _make_cache(ref.config)
    with torch.inference_mode():
        _write(ours, kvs, table, ctx, 0, c1)
        got1 = _ours_forward(ours, kvs, [(table, c1, block1)])
        want1 = ref(position_ids=torch.arange(c1 + B)[None], noise_embedding=block1[None],
                    target_hidden=ctx[None, :c1], past_key_values=cache, use_cache=True)[0]
        _crop_to(cache, c1)
        _write(ours, kvs, table, ctx, c1, c2)
        got2 = _ours_forward(ours, kvs, [(table, c2, block2)])
        want2 = ref(position_ids=torch.arange(c1, c2 + B)[None], noise_embedding=block2[None],
                    target_hidden=ctx[None, c1:c2], past_key_values=cache, use_cache=True)[0]
    torch.testing.assert_close(got1, want1, **TOL)
    torch.testing.assert_close(got2, want2, **TOL)
    torch.testing.assert_close(got2, _ref_forward(ref, ctx, block2), **TOL)


def test_convolution_is_causal_within_the_block(models):
    """Changing a later block position never changes an earlier position's conv output, and
    the first position sees only itself (zeros before the block)."""
    from models.dflash2 import block_conv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, H, generator=g)
    dyn = torch.randn(2, 6, 3, 4, generator=g)
    base = torch.randn(3, H, generator=g)
    y = block_conv(x, dyn, base)
    x2 = x.clone()
    x2[:, 4] += 1.0
    y2 = block_conv(x2, dyn, base)
    assert torch.equal(y[:, :4], y2[:, :4]) and not torch.equal(y[:, 4], y2[:, 4])
    torch.testing.assert_close(y[:, 0], (base[0] + dyn[:, 0, 0].repeat_interleave(16, -1)) * x[:, 0])


def test_max_abs_diff_report(models, capsys):
    """Prints the largest float32 differences (for the report)."""
    ref, ours, _ = models
    kvs = _pool(ours, "NHD")
    table = [7, 2, 11, 4, 0, 9]
    ctx, block = _inputs(113, 13)
    _write(ours, kvs, table, ctx, 0, 13)
    got = _ours_forward(ours, kvs, [(table, 13, block)])
    want = _ref_forward(ref, ctx, block)
    head = _head()
    with capsys.disabled():
        print(f"\nDFlash2 parity max abs diff: hidden {float((got - want).abs().max()):.2e}, "
              f"logits {float((got @ head.T - want @ head.T).abs().max()):.2e}")
