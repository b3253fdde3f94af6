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
