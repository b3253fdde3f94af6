"""Our paged DFlash draft against the reference ``dflash.model.DFlashDraftModel``."""

from __future__ import annotations

import pytest
import torch

from attention.backends.base import AttentionBatch
from attention.backends.torch_backend import TorchBackend
from attention.groups import LayerKVSpec, build_groups
from engine.kv_pool import KVPool
from engine.runner import slots_for
from models.dflash import DFlashConfig, DFlashDraftModel
from models.hf_folder import iter_safetensors, load_hf_config

from .helpers import save_draft

H, TAPS, BS, B = 64, 3, 4, 5  # hidden, tapped layers, KV block size, query block length
CPU = torch.device("cpu")
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity-draft")
    ref = save_draft(folder, seed=9, randomize_norms=True, layers=2, heads=4, kv_heads=2,
                     head_dim=16, block_size=8, target_layer_ids=(1, 3, 4),
                     num_target_layers=6, rope_theta=1e4, init=0.1)
    cfg = DFlashConfig.from_hf(load_hf_config(folder))
    ours = DFlashDraftModel(cfg, max_positions=128).float().eval()
    ours.load_weights(iter_safetensors(folder))
    return ref, ours


def _pool(ours, layout, num_blocks=24, dtype="auto"):
    c = ours.config
    names = [f"draft.layers.{i}" for i in range(c.num_layers)]
    specs = [LayerKVSpec(n, "draft", c.num_kv_heads, c.head_dim, dtype, BS) for n in names]
    groups = build_groups(specs, torch.float32)
    pool = KVPool(list(groups.values()), num_blocks, layout, CPU)
    return pool.layers(names)


def _inputs(seed, c):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(c, TAPS * H, generator=g)
    block = torch.randn(B, H, generator=g)
    return ctx, block


def _ours_forward(ours, kvs, reqs):
    """reqs: list of (table, c, block_embeds); context already written. Returns [n*B, H]."""
    slots = torch.cat([slots_for(t, c, c + B, BS) for t, c, _ in reqs])
    batch = AttentionBatch(q_lens=(B,) * len(reqs), kv_lens=tuple(c + B for _, c, _ in reqs),
                           block_tables=tuple(tuple(t) for t, _, _ in reqs),
                           slot_mapping=slots, causal=False, block_size=BS)
    meta = TorchBackend().build_metadata(batch, CPU)
    positions = torch.cat([torch.arange(c, c + B) for _, c, _ in reqs])
    embeds = torch.cat([e for _, _, e in reqs])
    with torch.inference_mode():
        return ours(embeds, positions, meta, kvs)


def _write(ours, kvs, table, ctx, start, end):
    with torch.inference_mode():
        ours.write_context(ctx[start:end], torch.arange(start, end),
                           slots_for(table, start, end, BS), kvs)


def _ref_forward(ref, ctx, block):
    c = ctx.shape[0]
    with torch.inference_mode():
        return ref(position_ids=torch.arange(c + B)[None], noise_embedding=block[None],
                   target_hidden=ctx[None])[0]


def test_config_parsed_from_reference_checkpoint(models):
    ref, ours = models
    c = ours.config
    assert c.target_layer_ids == tuple(ref.target_layer_ids) == (1, 3, 4)
    assert c.block_size == ref.block_size == 8
    assert c.mask_token_id == ref.mask_token_id
    assert c.rope_theta == pytest.approx(1e4)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("c", [1, 13])
def test_forward_matches_reference(models, layout, c):
    ref, ours = models
    kvs = _pool(ours, layout)
    table = [7, 2, 11, 4, 0, 9]  # scattered blocks: the context crosses block boundaries
    ctx, block = _inputs(100 + c, c)
    _write(ours, kvs, table, ctx, 0, c)
    got = _ours_forward(ours, kvs, [(table, c, block)])
    want = _ref_forward(ref, ctx, block)
    torch.testing.assert_close(got, want, **TOL)
    head = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(got[1:] @ head.T, want[1:] @ head.T, **TOL)
    assert torch.equal((got[1:] @ head.T).argmax(-1), (want[1:] @ head.T).argmax(-1))
    # the reference is sensitive to the context: a different context changes its output
    other = _ref_forward(ref, ctx + 1.0, block)
    assert (other - want).abs().max() > 1e-2


def test_batched_requests_match_reference_individually(models):
    ref, ours = models
    kvs = _pool(ours, "HND")
    reqs = []
    for seed, (table, c) in enumerate([([3, 8, 1, 14, 15], 13), ([5, 10, 16], 6), ([12, 17], 1)]):
        ctx, block = _inputs(seed, c)
        _write(ours, kvs, table, ctx, 0, c)
        reqs.append((table, c, block, ctx))
    got = _ours_forward(ours, kvs, [(t, c, b) for t, c, b, _ in reqs])
    for i, (_, _, block, ctx) in enumerate(reqs):
        torch.testing.assert_close(got[i * B: (i + 1) * B], _ref_forward(ref, ctx, block), **TOL)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_incremental_context_equals_one_shot(models, layout):
    _ref, ours = models
    c, split = 13, 5
    table = [6, 1, 9, 3, 13]
    ctx, block = _inputs(7, c)
    once = _pool(ours, layout)
    _write(ours, once, table, ctx, 0, c)
    twice = _pool(ours, layout)
    _write(ours, twice, table, ctx, 0, split)
    _write(ours, twice, table, ctx, split, c)
    slots = slots_for(table, 0, c, BS)
    for a, b in zip(once, twice):
        la, lb = a.logical, b.logical
        blocks, offs = slots // BS, slots % BS
        torch.testing.assert_close(la[blocks, :, offs], lb[blocks, :, offs],
                                   rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_ours_forward(ours, once, [(table, c, block)]),
                               _ours_forward(ours, twice, [(table, c, block)]), **TOL)


def test_incremental_matches_reference_cached_loop(models):
    """Two decoding steps as in the reference loop: step 1 sees context 0..c1-1 and a block at
    c1; the reference crops its cache to c1; step 2 adds context c1..c2-1 and a block at c2.
    Our step 2 writes only the new context and overwrites the stale block slots."""
    from dflash.model import _crop_to, _make_cache

    ref, ours = models
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


def test_default_target_layer_ids_match_reference():
    from dflash.model import build_target_layer_ids

    from models.dflash import default_target_layer_ids

    for n_target in (4, 6, 24, 30, 32, 36, 48):
        for n_draft in (1, 2, 3, 4, 5, 8):
            if n_draft > 1 and n_target - 3 <= 1:
                continue
            assert default_target_layer_ids(n_target, n_draft) == \
                build_target_layer_ids(n_target, n_draft), (n_target, n_draft)
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 3) == [1, 14, 27]
