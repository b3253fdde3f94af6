"""FlashInfer attention backend for CUDA GPUs (``pip install specserve[gpu]``).

Exact speculation. Greedy decoding with speculation must give the tokens plain decoding gives,
so a query row must be computed the same way whether it is a decode row (one query of its
request) or one of the ``K + 1`` rows of a verify window. FlashInfer's kernels do not promise
that: the decode and prefill kernels round differently, and even one prefill kernel picks its
query tile (``FA2DetermineCtaTileQ``, from the batch's average query length), and with it how
the KV loop is split across warps, and its KV split-and-merge (``split_kv``) from the whole
batch. So every causal request with at most ``ROW_MAX_Q`` new tokens (decode, verify windows,
short prompt chunks) is expanded into single-query *rows*: row ``j`` of a request becomes its
own entry with one query and ``kv_len - q_len + 1 + j`` keys, i.e. exactly the keys that query
may see, so no mask is needed. All rows of a step go through one FA2 prefill plan with one
query per entry (so the average query length, hence the tile, is always the GQA group size)
and split-KV disabled: a row's result then depends only on its own query, its own keys and the
model, never on its neighbours or on how many rows its request verifies. The verify rows of a
request re-read the request's pages once per row; those reads hit L2 (a 1k-token context is
4 MiB per layer for 8 KV heads), which is why this is the default rather than a mode (not yet
measured on a GPU). ``kv_split_pages`` turns on fixed-size KV splits (each row split into
chunks of that many pages from position 0) for long contexts at small batch, where a single
CTA per (row, KV head) is slow; it keeps chunk boundaries fixed but is not proven bit-exact.

Longer causal chunks (prefills above ``ROW_MAX_Q`` tokens) use a second, ordinary causal
prefill plan; a step that mixes both runs the two plans and scatters their outputs into place.
Non-causal groups (the DFlash query block) use one non-causal prefill plan. Each part is
planned once per step (on its first layer) from host index arrays; ``plan`` copies them to
the device itself, so building metadata reads nothing back from the GPU.

``kv_layout`` is the pool's resolved layout, read from the layer's ``LayerKV`` (never from a
config copy); the KV data type is the group's; the query dtype is the model's.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from dataclasses import dataclass, field

import torch

from attention.backends.base import AttentionBatch
from attention.backends.paged_indices import PagedIndices, build_paged_indices
from attention.dtypes import dtype_name
from attention.kv import LayerKV, SlotIndex, write_kv

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
WORKSPACE_BYTES = 128 << 20
ROW_MAX_Q = 64  # causal requests with at most this many new tokens are attended row by row


@dataclass(frozen=True)
class PlanPart:
    """One FlashInfer plan of a step: ``kind`` is ``rows`` (single-query entries, no mask, no
    KV split), ``chunks`` (causal multi-query entries) or ``block`` (non-causal entries).
    ``tokens`` are the packed positions of its queries in the step (None: all, in order)."""

    kind: str
    batch: AttentionBatch
    tokens: tuple[int, ...] | None


def split_batch(batch: AttentionBatch, row_max_q: int = ROW_MAX_Q) -> list[PlanPart]:
    """The plans of one group's step (host only; tested on CPU)."""
    empty = batch.slot_mapping[:0]
    if not batch.causal:
        return [PlanPart("block", batch, None)]
    rows: tuple[list, list, list] = ([], [], [])  # kv_lens, tables, packed token positions
    chunks: tuple[list, list, list, list] = ([], [], [], [])  # q_lens, kv_lens, tables, tokens
    start = 0
    for q, kv, table in zip(batch.q_lens, batch.kv_lens, batch.block_tables):
        if q <= row_max_q:
            for j in range(q):
                rows[0].append(kv - q + 1 + j)
                rows[1].append(table)
                rows[2].append(start + j)
        else:
            chunks[0].append(q)
            chunks[1].append(kv)
            chunks[2].append(table)
            chunks[3].extend(range(start, start + q))
        start += q
    parts = []
    if rows[0]:
        sub = AttentionBatch((1,) * len(rows[0]), tuple(rows[0]), tuple(rows[1]), empty,
                             causal=False, block_size=batch.block_size)
        parts.append(PlanPart("rows", sub, tuple(rows[2])))
    if chunks[0]:
        sub = AttentionBatch(tuple(chunks[0]), tuple(chunks[1]), tuple(chunks[2]), empty,
                             causal=True, block_size=batch.block_size)
        parts.append(PlanPart("chunks", sub, tuple(chunks[3])))
    if len(parts) == 1:
        parts[0] = PlanPart(parts[0].kind, parts[0].batch, None)  # all tokens, in order
    return parts


def _host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned when the device is CUDA, so copies from it are truly asynchronous."""
    return t.pin_memory() if device.type == "cuda" else t


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _host(t, device).to(device, non_blocking=True)


class FlashInferBackend:
    name = "flashinfer"
    supported_layouts = ("NHD", "HND")

    def __init__(self, device: torch.device, kv_split_pages: int | None = None,
                 row_max_q: int = ROW_MAX_Q) -> None:
        import flashinfer  # lazy: only on CUDA machines with the extra installed

        self._fi = flashinfer
        self.device = device
        self.kv_split_pages = kv_split_pages
        self.row_max_q = row_max_q
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, object] = {}
        self._planned_by: dict[tuple, tuple] = {}  # wrapper key -> (metadata serial, plan key)
        self._serial = itertools.count()
        plan = inspect.signature(self._fi.BatchPrefillWithPagedKVCacheWrapper.plan).parameters
        self.split_controls = "disable_split_kv" in plan
        # a graph plan sizes its query tile for the batch's worst case unless told every entry
        # has the same number of queries (FA2 only)
        self.uniform_hint = "uniform_q_len" in plan
        if not self.split_controls:
            log.warning("this FlashInfer has no disable_split_kv: decode and verify rows may "
                        "round differently, so greedy speculation may not equal plain greedy")

    def row_split_args(self) -> dict:
        """How rows split their keys: not at all, or in fixed chunks (``kv_split_pages``)."""
        if not self.split_controls:
            return {}
        if self.kv_split_pages:
            return {"fixed_split_size": self.kv_split_pages}
        return {"disable_split_kv": True}

    def check_support(
        self, kv_dtype: torch.dtype, q_dtype: torch.dtype, head_size: int, group: str
    ) -> None:
        if q_dtype not in Q_DTYPES or kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"Backend 'flashinfer' does not support KV dtype {dtype_name(kv_dtype)} with "
                f"query dtype {dtype_name(q_dtype)} for group {group!r}; query dtypes: "
                "float16, bfloat16; KV dtypes: float16, bfloat16, fp8_e4m3, fp8_e5m2"
            )
        if head_size not in HEAD_DIMS:
            raise ValueError(
                f"FlashInfer supports head_dim in {HEAD_DIMS}; group {group!r} has {head_size}"
            )

    def wrapper(self, kind: str, layout: str, group: str):
        """One prefill wrapper per (kind, layout, group), sharing the backend's workspace.
        ``rows`` wrappers are pinned to FA2, whose planner honours the KV split settings."""
        key = (kind, layout, group)
        if key not in self._wrappers:
            backend = "fa2" if kind == "rows" else "auto"
            self._wrappers[key] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, layout, backend=backend
            )
        return self._wrappers[key]

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> FlashInferMetadata:
        if batch.tree_masks is not None:
            raise NotImplementedError(
                "tree masks are not supported by the flashinfer backend yet; use the torch "
                "backend (attention_backend='torch') for tree verification")
        slots = batch.slot_mapping.cpu()  # the runner builds it on the host: no copy back
        idx = SlotIndex.build(slots, batch.block_size)
        idx = SlotIndex(
            None if idx.keep is None else _to(idx.keep, device),
            _to(idx.blocks, device), _to(idx.offsets, device),
        )
        parts = []
        for part in split_batch(batch, self.row_max_q):
            indices = build_paged_indices(part.batch)
            indices = PagedIndices(*(_host(t, device) for t in (
                indices.qo_indptr, indices.kv_indptr, indices.kv_indices,
                indices.kv_last_page_len)), indices.page_size)
            tokens = None
            if part.tokens is not None:
                tokens = _to(torch.tensor(part.tokens, dtype=torch.long), device)
            parts.append(_Part(part.kind, indices, tokens))
        return FlashInferMetadata(self, parts, idx, batch.num_tokens, next(self._serial))

    def graph_metadata(self, size: int, q_len: int, max_pages: int, query, kv: LayerKV
                       ) -> FlashInferGraphMetadata:
        """Static metadata for a CUDA graph (``engine.graphs``) of ``size`` entries of
        ``q_len`` queries: single-query rows (``q_len == 1``) or non-causal query blocks.
        ``query`` is the model's ``QueryShape``, ``kv`` any of its layers (one group)."""
        return FlashInferGraphMetadata(self, size, q_len, max_pages, query, kv)


@dataclass
class _Part:
    kind: str
    indices: PagedIndices  # host tensors (pinned on CUDA): plan copies them itself
    tokens: torch.Tensor | None  # packed query positions on the device (None: all)


@dataclass
class FlashInferMetadata:
    backend: FlashInferBackend
    parts: list[_Part]
    slots: SlotIndex
    num_tokens: int
    serial: int
    _plans: dict = field(default_factory=dict)

    def _plan(self, part: _Part, q: torch.Tensor, kv: LayerKV, scale: float):
        be = self.backend
        heads, kv_heads, dim = q.shape[1], kv.group.num_kv_heads, q.shape[2]
        wkey = (part.kind, kv.layout, kv.group.name)
        wrapper = be.wrapper(*wkey)
        key = (kv.layout, kv.dtype, q.dtype, heads, kv_heads, dim, scale)
        if be._planned_by.get(wkey) == (self.serial, key):
            return wrapper
        idx = part.indices
        extra = be.row_split_args() if part.kind == "rows" else {}
        wrapper.plan(
            idx.qo_indptr, idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len, heads,
            kv_heads, dim, idx.page_size, causal=part.kind == "chunks", q_data_type=q.dtype,
            kv_data_type=kv.dtype, sm_scale=scale, **extra,
        )
        be._planned_by[wkey] = (self.serial, key)
        return wrapper

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float
    ) -> torch.Tensor:
        write_kv(kv, k, v, self.slots)
        if len(self.parts) == 1 and self.parts[0].tokens is None:
            return self._run(self.parts[0], q.contiguous(), kv, scale)
        out = q.new_empty(q.shape)
        for part in self.parts:
            part_out = self._run(part, q.index_select(0, part.tokens), kv, scale)
            out.index_copy_(0, part.tokens, part_out)
        return out

    def _run(self, part: _Part, q: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
        wrapper = self._plan(part, q, kv, scale)
        return wrapper.run(q, kv.physical, k_scale=kv.k_scale, v_scale=kv.v_scale)


class FlashInferGraphMetadata:
    """The plan of one captured pass size, on fixed buffers.

    Every pass replayed at this size has exactly ``size`` entries (real and pad; see
    ``engine.graphs``) of ``q_len`` queries: rows of the target's steps (``q_len == 1``) or
    the draft's query blocks. The plan's batch size, query tile and schedule are therefore
    those of the capture; :meth:`prepare` re-plans them for the pass's keys (FlashInfer copies
    the index arrays into this wrapper's buffers) and writes its slots into static tensors,
    before the replay and outside the graph. :meth:`attend` (inside the graph) only writes
    K/V and runs. Each kind is planned as the eager backend plans it (rows: FA2, no KV split),
    so a row gives the same result captured or not; draft blocks are planned with FA2 and
    their fixed query count (``uniform_q_len``), so the capture's query tile fits them (the
    eager plan may choose another kernel: drafts need not match bit for bit)."""

    def __init__(self, backend: FlashInferBackend, size: int, q_len: int, max_pages: int,
                 query, kv: LayerKV) -> None:
        dev = backend.device
        self.backend = backend
        self.size = size
        self.q_len = q_len
        self.query = query
        self.kv_dtype = kv.dtype
        self.num_kv_heads = kv.group.num_kv_heads
        i32 = dict(dtype=torch.int32, device=dev)
        self.wrapper = backend._fi.BatchPrefillWithPagedKVCacheWrapper(
            backend.workspace, kv.layout, backend="fa2", use_cuda_graph=True,
            qo_indptr_buf=torch.arange(size + 1, **i32) * q_len,
            paged_kv_indptr_buf=torch.zeros(size + 1, **i32),
            paged_kv_indices_buf=torch.zeros(size * max_pages, **i32),
            paged_kv_last_page_len_buf=torch.zeros(size, **i32),
        )
        blocks = torch.zeros(size * q_len, dtype=torch.long, device=dev)
        self.slots = SlotIndex(None, blocks, torch.zeros_like(blocks))

    def _planned_batch(self, batch: AttentionBatch) -> AttentionBatch:
        if self.q_len == 1:
            parts = split_batch(batch, self.backend.row_max_q)
            if len(parts) == 1 and parts[0].kind == "rows":
                batch = parts[0].batch
            ok = batch.num_tokens == self.size and not batch.causal
        else:
            ok = (not batch.causal and len(batch.q_lens) == self.size
                  and all(q == self.q_len for q in batch.q_lens))
        if not ok:
            raise ValueError(f"a graph of {self.size} entries of {self.q_len} queries cannot "
                             f"run this pass (q_lens {batch.q_lens[:8]}...)")
        return batch

    def prepare(self, batch: AttentionBatch) -> None:
        """Plan the pass and load its slots (host work and asynchronous copies only)."""
        planned = self._planned_batch(batch)
        host = SlotIndex.build(batch.slot_mapping.cpu(), batch.block_size)
        if host.keep is not None:
            raise ValueError("a graphed pass needs a slot for every query (pad entries too)")
        dev = self.backend.device
        self.slots.blocks.copy_(_host(host.blocks, dev), non_blocking=True)
        self.slots.offsets.copy_(_host(host.offsets, dev), non_blocking=True)
        idx = build_paged_indices(planned)
        extra = self.backend.row_split_args() if self.q_len == 1 else {}
        if self.backend.uniform_hint:
            extra["uniform_q_len"] = self.q_len
        q = self.query
        self.wrapper.plan(
            *(_host(t, dev) for t in (idx.qo_indptr, idx.kv_indptr, idx.kv_indices,
                                      idx.kv_last_page_len)),
            q.num_heads, self.num_kv_heads, q.head_dim, idx.page_size, causal=False,
            q_data_type=q.dtype, kv_data_type=self.kv_dtype, sm_scale=q.scale, **extra,
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float
    ) -> torch.Tensor:
        write_kv(kv, k, v, self.slots)
        return self.wrapper.run(q.contiguous(), kv.physical, k_scale=kv.k_scale,
                                v_scale=kv.v_scale)
