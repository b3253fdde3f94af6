"""FlashInfer's paged index arrays, checked on CPU against the torch backend's slot mapping."""

from __future__ import annotations

import random

import pytest
import torch

from attention.backends import BackendUnavailableError, get_backend
from attention.backends.base import AttentionBatch
from attention.backends.paged_indices import PagedIndices, build_paged_indices
from engine.runner import slots_for


def decode_slots(indices: PagedIndices, request: int, positions: torch.Tensor) -> torch.Tensor:
    """Test oracle: the slot of each position of ``request`` according to the index arrays
    (-1 past its end)."""
    bs = indices.page_size
    start, end = int(indices.kv_indptr[request]), int(indices.kv_indptr[request + 1])
    kv_len = (end - start - 1) * bs + int(indices.kv_last_page_len[request])
    pages = indices.kv_indices[start:end].long()
    page = positions // bs
    valid = positions < kv_len
    slots = pages[page.clamp(max=end - start - 1)] * bs + positions % bs
    return torch.where(valid, slots, torch.full_like(slots, -1))


def _random_batch(rng: random.Random, block_size: int, draft: bool) -> tuple[AttentionBatch, list]:
    blocks = list(range(200))
    rng.shuffle(blocks)
    q_lens, kv_lens, tables, slots = [], [], [], []
    for _ in range(rng.randint(1, 6)):
        context = rng.randint(0, 40)
        q = rng.randint(2, 8) if draft else rng.choice([1, 1, rng.randint(1, 20)])
        kv_len = context + q
        table = [blocks.pop() for _ in range(-(-(kv_len + 3) // block_size))]  # + look-ahead
        q_lens.append(q)
        kv_lens.append(kv_len)
        tables.append(tuple(table))
        slots.append(slots_for(list(table), context, kv_len, block_size))
    batch = AttentionBatch(tuple(q_lens), tuple(kv_lens), tuple(tables), torch.cat(slots),
                           causal=not draft, block_size=block_size)
    return batch, tables


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_index_arrays_decode_to_the_torch_slot_mapping(block_size, draft, seed):
    rng = random.Random(seed * 31 + block_size)
    batch, tables = _random_batch(rng, block_size, draft)
    idx = build_paged_indices(batch)
    assert idx.qo_indptr.dtype == idx.kv_indptr.dtype == idx.kv_indices.dtype == torch.int32
    assert idx.qo_indptr.tolist()[-1] == batch.num_tokens
    assert ((idx.kv_last_page_len >= 1) & (idx.kv_last_page_len <= block_size)).all()
    start = 0
    for i, (q, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        positions = torch.arange(kv_len)
        expected = slots_for(list(tables[i]), 0, kv_len, block_size)
        assert torch.equal(decode_slots(idx, i, positions), expected)
        # the new tokens' slots (what the torch backend writes) are the last q positions
        assert torch.equal(decode_slots(idx, i, torch.arange(kv_len - q, kv_len)),
                           batch.slot_mapping[start : start + q])
        assert decode_slots(idx, i, torch.tensor([kv_len]))[0] == -1
        start += q


def test_flashinfer_without_cuda_gives_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(BackendUnavailableError, match="FlashInfer backend needs a CUDA device "
                                                      "and the flashinfer package"):
        get_backend("flashinfer", torch.device("cpu"))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="Unknown attention backend 'magic'"):
        get_backend("magic", torch.device("cpu"))


# --------------------------------------------------------------------------- row-invariant plans


def _entry(idx, e: int) -> tuple[list[int], int]:
    """The pages and last-page length of entry ``e`` of a plan's index arrays."""
    a, b = int(idx.kv_indptr[e]), int(idx.kv_indptr[e + 1])
    return idx.kv_indices[a:b].tolist(), int(idx.kv_last_page_len[e])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("row_max_q", [1, 8, 64])
def test_split_batch_attends_each_row_over_exactly_its_causal_prefix(seed, row_max_q):
    from attention.backends.flashinfer_backend import split_batch

    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    blocks = list(range(400))
    rng.shuffle(blocks)
    q_lens, kv_lens, tables, slots = [], [], [], []
    for _ in range(rng.randint(1, 6)):
        q = rng.choice([1, 1, rng.randint(2, 9), rng.randint(10, 90)])
        context = rng.randint(0, 50)
        table = tuple(blocks.pop() for _ in range(-(-(context + q) // bs)))
        q_lens.append(q)
        kv_lens.append(context + q)
        tables.append(table)
        slots.append(slots_for(list(table), context, context + q, bs))
    batch = AttentionBatch(tuple(q_lens), tuple(kv_lens), tuple(tables), torch.cat(slots),
                           causal=True, block_size=bs)
    parts = split_batch(batch, row_max_q)
    # every query of the step is computed by exactly one part
    covered = []
    for part in parts:
        covered += list(part.tokens) if part.tokens is not None else list(range(batch.num_tokens))
    assert sorted(covered) == list(range(batch.num_tokens))
    owner = {}  # packed position -> (request, index in request)
    start = 0
    for i, q in enumerate(q_lens):
        for j in range(q):
            owner[start + j] = (i, j)
        start += q
    for part in parts:
        idx = build_paged_indices(part.batch)
        tokens = part.tokens if part.tokens is not None else range(batch.num_tokens)
        if part.kind == "rows":
            assert set(part.batch.q_lens) == {1} and not part.batch.causal
            for e, t in enumerate(tokens):
                i, j = owner[t]
                assert q_lens[i] <= row_max_q
                visible = kv_lens[i] - q_lens[i] + 1 + j  # the query's own position included
                assert part.batch.kv_lens[e] == visible
                assert torch.equal(decode_slots(idx, e, torch.arange(visible)),
                                   slots_for(list(tables[i]), 0, visible, bs))
                assert decode_slots(idx, e, torch.tensor([visible]))[0] == -1
        else:
            assert part.kind == "chunks" and part.batch.causal
            assert all(q > row_max_q for q in part.batch.q_lens)
            assert [owner[t] for t in tokens] == [
                (i, j) for i, q in enumerate(q_lens) if q > row_max_q for j in range(q)]


def test_verify_rows_get_the_same_plan_entries_as_plain_decode_rows():
    """What makes greedy speculation equal plain greedy on FlashInfer: the row that verifies a
    draft at position p is planned exactly like the decode row at position p."""
    from attention.backends.flashinfer_backend import split_batch

    bs, table, context, k = 4, (7, 3, 9, 1, 12, 5), 9, 6
    verify = AttentionBatch((k + 1, 1), (context + k + 1, 5), (table, (20, 21)),
                            torch.zeros(k + 2, dtype=torch.long), causal=True, block_size=bs)
    (part,) = split_batch(verify)
    assert part.kind == "rows" and part.tokens is None
    vidx = build_paged_indices(part.batch)
    for j in range(k + 1):
        decode = AttentionBatch((1,), (context + j + 1,), (table,),
                                torch.zeros(1, dtype=torch.long), causal=True, block_size=bs)
        (alone,) = split_batch(decode)
        assert _entry(build_paged_indices(alone.batch), 0) == _entry(vidx, j)


def test_non_causal_blocks_are_one_plan_unchanged():
    from attention.backends.flashinfer_backend import split_batch

    batch = AttentionBatch((8, 8), (20, 12), ((1, 2), (3,)), torch.zeros(16, dtype=torch.long),
                           causal=False, block_size=16)
    (part,) = split_batch(batch)
    assert part.kind == "block" and part.batch is batch and part.tokens is None


# --------------------------------------------------------------------------- backend plumbing


class _FakeWrapper:
    """Stands in for FlashInfer's paged prefill wrapper on the CPU: ``run`` attends every entry
    of the last ``plan`` over the pages its index arrays name (bottom-right causal if planned)."""

    plans: list = []

    def __init__(self, workspace, layout, backend="auto"):
        self.layout, self.backend = layout, backend

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, heads, kv_heads, dim,
             page_size, causal=False, q_data_type=None, kv_data_type=None, sm_scale=None,
             disable_split_kv=False, fixed_split_size=None):
        for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32  # host arrays, no readback
        self.args = (qo_indptr, kv_indptr, kv_indices, last_page_len, page_size, causal, sm_scale)
        _FakeWrapper.plans.append({"backend": self.backend, "causal": causal,
                                   "entries": len(qo_indptr) - 1,
                                   "disable_split_kv": disable_split_kv})

    def run(self, q, physical, k_scale=1.0, v_scale=1.0):
        qo, kvp, pages, last, ps, causal, scale = self.args
        assert q.shape[0] == int(qo[-1])
        out = torch.empty_like(q)
        for e in range(len(qo) - 1):
            ids = pages[int(kvp[e]) : int(kvp[e + 1])].long()
            kv_len = (len(ids) - 1) * ps + int(last[e])
            cache = physical[ids]  # [n, 2, ps, H, D] (NHD) or [n, 2, H, ps, D] (HND)
            if self.layout == "HND":
                cache = cache.transpose(2, 3)
            k = cache[:, 0].reshape(-1, *cache.shape[-2:])[:kv_len].float() * k_scale
            v = cache[:, 1].reshape(-1, *cache.shape[-2:])[:kv_len].float() * v_scale
            qe = q[int(qo[e]) : int(qo[e + 1])].float()
            n = qe.shape[0]
            group = qe.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", qe, k) * scale
            if causal:
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
                s = s.masked_fill(~allowed, float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
            out[int(qo[e]) : int(qo[e + 1])] = attn.to(q.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys
    import types

    from attention.backends import flashinfer_backend

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = _FakeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 16)
    _FakeWrapper.plans = []
    return flashinfer_backend


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", ["decode", "verify", "mixed", "block"])
def test_backend_plans_once_per_step_and_matches_the_torch_backend(fake_flashinfer, layout, case):
    """The backend's parts, plans and output scatter, run on the CPU through a reference
    stand-in for the kernels, against the torch backend on the same pool."""
    from attention.groups import LayerKVSpec, build_groups
    from engine.kv_pool import KVPool

    bs, heads, kv_heads, dim = 4, 4, 2, 8
    specs = [LayerKVSpec(f"t{i}", "target", kv_heads, dim, "auto", bs) for i in range(2)]
    groups = build_groups(specs, torch.float32)
    pool = KVPool(list(groups.values()), num_blocks=64, layout=layout, device=torch.device("cpu"))
    q_lens, ctx = {"decode": ([1, 1, 1], [9, 2, 14]), "verify": ([5, 1, 3], [6, 11, 0]),
                   "mixed": ([80, 4, 1], [0, 7, 20]), "block": ([4, 4], [10, 3])}[case]
    causal = case != "block"
    rng = random.Random(1)
    free = list(range(64))
    rng.shuffle(free)
    tables = [tuple(free.pop() for _ in range(-(-(c + q) // bs))) for q, c in zip(q_lens, ctx)]
    gen = torch.Generator().manual_seed(0)
    torch_backend = get_backend("torch", torch.device("cpu"))
    for name in ("t0", "t1"):  # context K/V written by the torch backend
        kv = pool.layer(name)
        for t, c in zip(tables, ctx):
            if c:
                batch = AttentionBatch((c,), (c,), (t,), slots_for(list(t), 0, c, bs), True, bs)
                k = torch.randn(c, kv_heads, dim, generator=gen)
                torch_backend.build_metadata(batch, torch.device("cpu")).attend(
                    torch.randn(c, heads, dim, generator=gen), k, k.clone(), kv, dim**-0.5)
    slots = torch.cat([slots_for(list(t), c, c + q, bs) for t, c, q in zip(tables, ctx, q_lens)])
    batch = AttentionBatch(tuple(q_lens), tuple(c + q for c, q in zip(ctx, q_lens)), tuple(tables),
                           slots, causal, bs)
    n = batch.num_tokens
    backend = fake_flashinfer.FlashInferBackend(torch.device("cpu"))
    meta = backend.build_metadata(batch, torch.device("cpu"))
    ref_meta = torch_backend.build_metadata(batch, torch.device("cpu"))
    for name in ("t0", "t1"):  # two layers: one plan per part for the whole step
        kv = pool.layer(name)
        q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        got = meta.attend(q, k, v, kv, dim**-0.5)
        want = ref_meta.attend(q, k, v, kv, dim**-0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    kinds = [(p["backend"], p["causal"], p["entries"], p["disable_split_kv"])
             for p in _FakeWrapper.plans]
    rows = sum(q for q in q_lens if q <= fake_flashinfer.ROW_MAX_Q)
    expected = {
        "decode": [("fa2", False, 3, True)],
        "verify": [("fa2", False, rows, True)],
        "mixed": [("fa2", False, rows, True), ("auto", True, 1, False)],
        "block": [("auto", False, 2, False)],
    }[case]
    assert kinds == expected
    # the next step plans again
    backend.build_metadata(batch, torch.device("cpu")).attend(q, k, v, pool.layer("t0"), dim**-0.5)
    assert len(_FakeWrapper.plans) == 2 * len(expected)
