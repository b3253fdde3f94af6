"""Attention backend in PyTorch (runs on CPU and GPU).

On the CPU it runs the batch-invariant paged kernel (``attention/csrc/paged_attention.cpp``,
built on first use): one call per layer for the whole batch, reading K/V straight from the
pages, every query row computed by the same operations whatever its batch mates or its
request's query length. ``SPECSERVE_CPU_ATTENTION=sdpa`` (or a machine without a compiler, or
a CUDA device) selects the SDPA path below, which stays the reference.

SDPA path: queries of a step are padded per request to ``[B, Hq, max_q, D]``, the request's pages are
gathered to ``[B, Hkv, S, D]``, and one masked SDPA call covers the batch. When requests have
very different query lengths (a long prefill next to decodes), requests are split into buckets
of similar length so padding stays cheap.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention.backends.base import TREE_MAX_Q, AttentionBatch, check_tree_masks
from attention.dtypes import dtype_name
from attention.kv import LayerKV, SlotIndex, gather_kv, write_kv


CPU_ATTENTION_ENV = "SPECSERVE_CPU_ATTENTION"
CPU_KERNELS = ("auto", "paged", "sdpa")


def cpu_kernel_choice(requested: str | None = None) -> str:
    """``paged`` or ``sdpa`` for CPU steps: the argument, else ``SPECSERVE_CPU_ATTENTION``,
    else ``auto`` (the paged kernel when it builds here). Read at every ``build_metadata`` so a
    benchmark can alternate the two in one process."""
    value = (requested or os.environ.get(CPU_ATTENTION_ENV) or "auto").strip().lower()
    if value not in CPU_KERNELS:
        raise ValueError(
            f"Unknown CPU attention kernel {value!r} ({CPU_ATTENTION_ENV}); valid: "
            f"{', '.join(CPU_KERNELS)}"
        )
    if value == "sdpa":
        return "sdpa"
    from attention import cpu_kernel

    if cpu_kernel.available():
        return "paged"
    if value == "paged":
        raise RuntimeError(f"CPU paged-attention kernel unavailable: {cpu_kernel.error()}")
    return "sdpa"


class TorchBackend:
    name = "torch"
    supported_layouts = ("NHD", "HND")

    def __init__(self, cpu_kernel: str | None = None) -> None:
        self.cpu_kernel = cpu_kernel  # None: SPECSERVE_CPU_ATTENTION, else auto

    def check_support(
        self, kv_dtype: torch.dtype, q_dtype: torch.dtype, head_size: int, group: str
    ) -> None:
        supported = (torch.float32, torch.bfloat16, torch.float16,
                     torch.float8_e4m3fn, torch.float8_e5m2)
        if kv_dtype not in supported:
            raise ValueError(
                f"Backend 'torch' does not support KV dtype {dtype_name(kv_dtype)} for group "
                f"{group!r}"
            )

    def build_metadata(
        self, batch: AttentionBatch, device: torch.device
    ) -> TorchMetadata | PagedMetadata:
        if device.type == "cpu" and cpu_kernel_choice(self.cpu_kernel) == "paged":
            return build_paged_metadata(batch, device)
        if batch.tree_masks is not None:  # (the paged kernel checks them itself)
            check_tree_masks(batch.q_lens, batch.tree_masks)
        starts = [0]
        for n in batch.q_lens:
            starts.append(starts[-1] + n)
        order = sorted(range(len(batch.q_lens)), key=lambda i: batch.q_lens[i])
        buckets: list[_Bucket] = []
        current: list[int] = []
        for i in order:
            # Start a new bucket when padding this request's bucket would waste too much.
            if current and batch.q_lens[i] > 2 * max(1, batch.q_lens[current[0]]):
                buckets.append(_make_bucket(current, batch, starts, device))
                current = []
            current.append(i)
        if current:
            buckets.append(_make_bucket(current, batch, starts, device))
        # one bucket of equal-length requests already in packed order: no gather/scatter needed
        identity = len(buckets) == 1 and buckets[0].valid is None and order == sorted(order)
        slots = SlotIndex.build(batch.slot_mapping, batch.block_size, device)
        return TorchMetadata(slots, buckets, batch.num_tokens, identity)


@dataclass
class _Bucket:
    token_index: torch.Tensor  # packed token index per valid padded cell
    valid: torch.Tensor | None  # padded cells holding a real token (indices), None: no padding
    block_tables: torch.Tensor  # [B, nblk]
    mask: torch.Tensor | None  # [B, 1, max_q, S] bool or None (all visible)
    batch: int
    max_q: int
    kv_len: int | None = None  # set for a single request: K/V are cut to this length
    is_causal: bool = False


def _make_bucket(
    reqs: list[int], batch: AttentionBatch, starts: list[int], device: torch.device
) -> _Bucket:
    q_lens = [batch.q_lens[i] for i in reqs]
    kv_lens = [batch.kv_lens[i] for i in reqs]
    max_q, max_kv = max(q_lens), max(kv_lens)
    bs = batch.block_size
    nblk = (max_kv + bs - 1) // bs
    tables = torch.zeros((len(reqs), nblk), dtype=torch.long)
    for row, i in enumerate(reqs):
        table = batch.block_tables[i][:nblk]
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
    span = nblk * bs
    q_pos = torch.arange(max_q)
    k_pos = torch.arange(span)
    ql = torch.tensor(q_lens)[:, None, None]
    kl = torch.tensor(kv_lens)[:, None, None]
    visible = k_pos[None, None, :] < kl
    if batch.causal:
        # query j of a request sits at absolute position kv_len - q_len + j
        visible = visible & (k_pos[None, None, :] <= (kl - ql + q_pos[None, :, None]))
    tree = batch.tree_masks is not None and _apply_tree_masks(visible, reqs, batch, starts,
                                                              k_pos)
    needs_mask = batch.causal and max_q > 1 or any(k != span for k in kv_lens) or tree
    mask = visible[:, None].to(device) if needs_mask else None
    kv_len, is_causal = None, False
    if len(reqs) == 1:
        # one request: cut the gathered span to its length, so SDPA needs no mask at all
        kv_len = kv_lens[0]
        mask = (visible[:, None, :, :kv_len].to(device) if batch.causal and max_q > 1 or tree
                 else None)
        if mask is not None and max_q == kv_len and not tree:
            mask, is_causal = None, True  # plain prefill: top-left causal is the same thing
    uniform = all(q == max_q for q in q_lens)
    token_index = torch.cat([torch.arange(starts[i], starts[i] + batch.q_lens[i]) for i in reqs])
    if uniform:
        valid = None
    else:
        # indices, computed on the host once per step: layers index with them and never build
        # a boolean mask (a device sync on CUDA)
        cells = (q_pos[None, :] < torch.tensor(q_lens)[:, None]).reshape(-1)
        valid = torch.nonzero(cells).flatten().to(device)
    return _Bucket(
        token_index=token_index.to(device), valid=valid,
        block_tables=tables.to(device), mask=mask, batch=len(reqs), max_q=max_q,
        kv_len=kv_len, is_causal=is_causal,
    )


def _apply_tree_masks(visible: torch.Tensor, reqs: list[int], batch: AttentionBatch,
                      starts: list[int], k_pos: torch.Tensor) -> bool:
    """Restrict the rows of ``visible [B, max_q, span]`` that carry a nonzero tree mask to
    their request's context ``[0, base)`` plus the query-block offsets set in the mask; True
    when any row of the bucket has one."""
    masks = batch.tree_masks
    any_tree = False
    for row, i in enumerate(reqs):
        q_len, kv_len = batch.q_lens[i], batch.kv_lens[i]
        m = masks[starts[i]: starts[i] + q_len]
        rows = m != 0
        if not bool(rows.any()):
            continue
        any_tree = True
        base = kv_len - q_len
        off = k_pos - base
        in_block = (off >= 0) & (off < min(q_len, TREE_MAX_Q))
        bits = (m[:, None] >> off.clamp(0, TREE_MAX_Q - 1)[None, :]) & 1
        tree_vis = (k_pos < base)[None, :] | (in_block[None, :] & (bits != 0))
        visible[row, :q_len] = torch.where(rows[:, None], tree_vis, visible[row, :q_len])
    return any_tree


@dataclass
class TorchMetadata:
    slots: SlotIndex
    buckets: list[_Bucket]
    num_tokens: int
    identity: bool = False

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float
    ) -> torch.Tensor:
        write_kv(kv, k, v, self.slots)
        num_heads, head_dim = q.shape[1], q.shape[2]
        if self.identity:
            return _attend_bucket(q, kv, self.buckets[0], scale)
        out = q.new_empty(q.shape)
        for b in self.buckets:
            qb = q.index_select(0, b.token_index)
            if b.valid is not None:
                padded = q.new_zeros((b.batch * b.max_q, num_heads, head_dim))
                padded.index_copy_(0, b.valid, qb)
                qb = padded
            ob = _attend_bucket(qb, kv, b, scale)
            if b.valid is not None:
                ob = ob.index_select(0, b.valid)
            out.index_copy_(0, b.token_index, ob)
        return out


def _attend_bucket(q: torch.Tensor, kv: LayerKV, b: _Bucket, scale: float) -> torch.Tensor:
    """Attention for one padded bucket; ``q`` is ``[B*max_q, Hq, D]`` in padded order."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    qb = q.view(b.batch, b.max_q, num_heads, head_dim).transpose(1, 2)
    kb, vb = gather_kv(kv, b.block_tables, q.dtype)
    if b.kv_len is not None:
        kb, vb = kb[:, :, : b.kv_len], vb[:, :, : b.kv_len]
    ob = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=b.mask, scale=scale, is_causal=b.is_causal,
        enable_gqa=num_heads != kb.shape[1],
    )
    return ob.transpose(1, 2).reshape(b.batch * b.max_q, num_heads, head_dim)


def build_paged_metadata(batch: AttentionBatch, device: torch.device) -> PagedMetadata:
    """Index tensors for the paged kernel, built once per step from the host's lists (one
    tensor each: a step of one request with a draft block took 134 us in tensor ops, most of
    a one-layer draft's attention work)."""
    tables = batch.block_tables
    width = max(1, max(map(len, tables), default=1))
    padded = [t if len(t) == width else (*t, *(0,) * (width - len(t))) for t in tables]
    q_indptr = torch.tensor([0, *itertools.accumulate(batch.q_lens)], dtype=torch.long)
    kv_lens = torch.tensor(batch.kv_lens, dtype=torch.long)
    block_tables = (torch.tensor(padded, dtype=torch.long) if padded
                    else torch.zeros((0, 1), dtype=torch.long))
    slots = SlotIndex.build(batch.slot_mapping, batch.block_size, device)
    masks = batch.tree_masks
    if masks is not None:  # the kernel checks them (every layer: a pass over N integers)
        masks = masks.to(device=device, dtype=torch.long).contiguous()
    if device.type != "cpu":
        block_tables, q_indptr, kv_lens = (t.to(device) for t in (block_tables, q_indptr, kv_lens))
    return PagedMetadata(slots, block_tables, q_indptr, kv_lens, batch.causal, batch.num_tokens,
                         masks)


@dataclass
class PagedMetadata:
    slots: SlotIndex
    block_tables: torch.Tensor  # [B, widest] int64
    q_indptr: torch.Tensor  # [B+1] int64
    kv_lens: torch.Tensor  # [B] int64
    causal: bool
    num_tokens: int
    tree_masks: torch.Tensor | None = None  # [num_tokens] int64 (AttentionBatch.tree_masks)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float
    ) -> torch.Tensor:
        from attention import cpu_kernel

        write_kv(kv, k, v, self.slots)
        if self.num_tokens == 0:
            return q.new_empty(q.shape)
        return cpu_kernel.paged_attention(
            q, kv.logical, self.block_tables, self.q_indptr, self.kv_lens, self.causal, scale,
            kv.k_scale, kv.v_scale, tree_masks=self.tree_masks,
        )
