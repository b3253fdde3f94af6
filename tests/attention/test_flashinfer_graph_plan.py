"""The host side of the FlashInfer backend's CUDA-graph metadata, on the CPU.

FlashInfer needs CUDA, so its prefill wrapper is replaced here by a recorder that keeps what
the backend passes to it and enforces the rules FlashInfer's CUDA-graph mode enforces (a fixed
batch size, index arrays that fit the buffers given at construction). What is checked: a
graphed step plans its real rows exactly as the eager backend plans them, pad rows point at
the pad block alone, draft blocks keep their query tile, and steps a graph cannot run are
refused. The kernels themselves run in tests/gpu.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attention.backends.base import AttentionBatch
from attention.groups import LayerKVSpec, build_groups
from engine.config import GraphConfig
from engine.graphs import PaddedPasses, PadSpace, QueryShape
from engine.kv_pool import KVPool
from engine.runner import slots_for

BS = 16
PAD_BLOCK = 63
QUERY = QueryShape(num_heads=8, head_dim=64, dtype=torch.bfloat16, scale=0.125)


class RecordingWrapper:
    """Keeps constructor buffers and plan arguments; checks CUDA-graph mode's rules."""

    def __init__(self, workspace, layout, backend="auto", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None):
        self.layout, self.backend, self.graph = layout, backend, use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                     paged_kv_last_page_len_buf)
        self.plans: list[dict] = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
             head_dim, page_size, causal=False, q_data_type=None, kv_data_type=None,
             sm_scale=None, disable_split_kv=False, fixed_split_size=None, uniform_q_len=None):
        if self.graph:
            assert len(qo_indptr) == len(self.bufs[0]), "batch size fixed in CUDA-graph mode"
            assert torch.equal(qo_indptr.to(torch.int32), self.bufs[0]), "query rows are fixed"
            assert len(kv_indices) <= len(self.bufs[2]), "indices exceed the buffer"
        self.plans.append(dict(
            qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
            kv_indices=kv_indices.tolist(), last=last_page_len.tolist(),
            heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size, causal=causal,
            dtypes=(q_data_type, kv_data_type), scale=sm_scale,
            disable_split_kv=disable_split_kv, fixed_split_size=fixed_split_size,
            uniform_q_len=uniform_q_len))


@pytest.fixture
def backend(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = RecordingWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from attention.backends.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(torch.device("cpu"))


@pytest.fixture
def kv():
    specs = [LayerKVSpec("t0", "target", 2, 64, "bfloat16", BS)]
    groups = build_groups(specs, torch.bfloat16)
    return KVPool(list(groups.values()), num_blocks=64, layout="HND",
                  device=torch.device("cpu")).layer("t0")


def _batch(q_lens, ctx_lens, tables, causal=True) -> AttentionBatch:
    slots = torch.cat([slots_for(list(t), c, c + q, BS)
                       for t, c, q in zip(tables, ctx_lens, q_lens)])
    return AttentionBatch(tuple(q_lens), tuple(c + q for c, q in zip(ctx_lens, q_lens)),
                          tuple(tuple(t) for t in tables), slots, causal=causal, block_size=BS)


def _passes(backend, kv, q_len=1, sizes=(4, 8, 16)) -> PaddedPasses:
    return PaddedPasses(lambda *a: (), kv, backend, torch.device("cpu"),
                        GraphConfig(sizes, capture=False), PadSpace(PAD_BLOCK, 8), QUERY, q_len)


def _eager_rows_plan(backend, kv, batch) -> dict:
    meta = backend.build_metadata(batch, torch.device("cpu"))
    (part,) = meta.parts
    q = torch.zeros(batch.num_tokens, QUERY.num_heads, QUERY.head_dim, dtype=QUERY.dtype)
    wrapper = meta._plan(part, q, kv, QUERY.scale)
    return wrapper.plans[-1]


def test_graph_rows_plan_is_the_eager_rows_plan_plus_pad_rows(backend, kv):
    # a decode row, a verify window of 4 and a short prompt chunk of 2: 7 rows, padded to 8
    batch = _batch([1, 4, 2], [30, 17, 0], [[5, 6], [7, 8], [9]])
    passes = _passes(backend, kv)
    padded = passes.pad(batch, 8)
    meta = backend.graph_metadata(8, 1, 8, QUERY, kv)
    assert meta.wrapper.graph and meta.wrapper.backend == "fa2"
    assert len(meta.wrapper.bufs[2]) == 8 * 8  # rows x pages of the longest context
    meta.prepare(padded)
    graph = meta.wrapper.plans[-1]
    eager = _eager_rows_plan(backend, kv, batch)
    n = batch.num_tokens
    assert graph["qo_indptr"] == list(range(9)) and eager["qo_indptr"] == list(range(n + 1))
    assert graph["kv_indptr"][: n + 1] == eager["kv_indptr"]
    real_pages = eager["kv_indptr"][-1]
    assert graph["kv_indices"][:real_pages] == eager["kv_indices"]
    assert graph["kv_indices"][real_pages:] == [PAD_BLOCK]  # the pad row: one key, pad block
    assert graph["last"][:n] == eager["last"] and graph["last"][n:] == [1]
    for key in ("heads", "page_size", "causal", "dtypes", "scale", "disable_split_kv",
                "fixed_split_size"):
        assert graph[key] == eager[key], key
    assert graph["causal"] is False and graph["disable_split_kv"] is True
    assert graph["uniform_q_len"] == 1  # the capture's query tile: one query per entry
    # the step's slots went into the static index: real rows first, then the pad slot
    slots = meta.slots.blocks * BS + meta.slots.offsets
    assert slots.tolist() == batch.slot_mapping.tolist() + [PAD_BLOCK * BS]


def test_graph_block_plan_keeps_the_query_tile(backend, kv):
    """Draft query blocks of K + 1 = 4: the plan's query rows are fixed at capture."""
    batch = _batch([4, 4, 4], [20, 3, 40], [[1, 2], [3], [4, 5, 6]], causal=False)
    passes = _passes(backend, kv, q_len=4, sizes=(1, 2, 4))
    meta = backend.graph_metadata(4, 4, 8, QUERY, kv)
    assert meta.wrapper.backend == "fa2" and meta.wrapper.bufs[0].tolist() == [0, 4, 8, 12, 16]
    meta.prepare(passes.pad(batch, 4))
    plan = meta.wrapper.plans[-1]
    assert plan["kv_indptr"] == [0, 2, 3, 6, 7] and plan["kv_indices"][-1] == PAD_BLOCK
    assert plan["last"][-1] == 4 and plan["causal"] is False and plan["uniform_q_len"] == 4
    assert plan["disable_split_kv"] is False  # blocks split their keys as the eager plan does


def test_graph_metadata_refuses_what_it_was_not_captured_for(backend, kv):
    meta = backend.graph_metadata(8, 1, 8, QUERY, kv)
    passes = _passes(backend, kv)
    with pytest.raises(ValueError, match="cannot run this pass"):
        meta.prepare(passes.pad(_batch([1, 1], [3, 4], [[1], [2]]), 4))  # 4 rows, not 8
    chunk = _batch([70], [0], [[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="cannot run this pass"):
        meta.prepare(chunk)  # a long chunk is not rows
    assert not passes.fits(chunk)
    unpadded = _batch([1] * 8, [2] * 8, [[i] for i in range(8)])
    bad = AttentionBatch(unpadded.q_lens, unpadded.kv_lens, unpadded.block_tables,
                         torch.full((8,), -1), True, BS)
    with pytest.raises(ValueError, match="slot for every query"):
        meta.prepare(bad)
