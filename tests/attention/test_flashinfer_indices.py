"""FlashInfer's paged index arrays, checked on CPU against the torch backend's slot mapping."""

from __future__ import annotations

import random

import pytest
import torch

from attention.backends import BackendUnavailableError, get_backend
from attention.backends.base import AttentionBatch
from attention.backends.paged_indices import build_paged_indices, decode_slots
from engine.runner import slots_for


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
        decode = AttentionBatch((1,), (context + j + 1,), (table,), torch.zeros(1, dtype=torch.long),
                                causal=True, block_size=bs)
        (alone,) = split_batch(decode)
        assert _entry(build_paged_indices(alone.batch), 0) == _entry(vidx, j)


def test_non_causal_blocks_are_one_plan_unchanged():
    from attention.backends.flashinfer_backend import split_batch

    batch = AttentionBatch((8, 8), (20, 12), ((1, 2), (3,)), torch.zeros(16, dtype=torch.long),
                           causal=False, block_size=16)
    (part,) = split_batch(batch)
    assert part.kind == "block" and part.batch is batch and part.tokens is None
