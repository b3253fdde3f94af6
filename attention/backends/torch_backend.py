"""Reference attention backend in plain PyTorch (runs on CPU and GPU).

Queries of a step are padded per request to ``[B, Hq, max_q, D]``, the request's pages are
gathered to ``[B, Hkv, S, D]``, and one masked SDPA call covers the batch. When requests have
very different query lengths (a long prefill next to decodes), requests are split into buckets
of similar length so padding stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention.backends.base import AttentionBatch
from attention.dtypes import dtype_name
from attention.kv import LayerKV, SlotIndex, gather_kv, write_kv


class TorchBackend:
    name = "torch"
    supported_layouts = ("NHD", "HND")

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

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> TorchMetadata:
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
        slots = SlotIndex.build(batch.slot_mapping.to(device), batch.block_size)
        return TorchMetadata(slots, buckets, batch.num_tokens, identity)


@dataclass
class _Bucket:
    token_index: torch.Tensor  # packed token index per valid padded cell
    valid: torch.Tensor | None  # [B*max_q] bool, None when no padding
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
    needs_mask = batch.causal and max_q > 1 or any(k != span for k in kv_lens)
    mask = visible[:, None].to(device) if needs_mask else None
    kv_len, is_causal = None, False
    if len(reqs) == 1:
        # one request: cut the gathered span to its length, so SDPA needs no mask at all
        kv_len = kv_lens[0]
        mask = visible[:, None, :, :kv_len].to(device) if batch.causal and max_q > 1 else None
        if mask is not None and max_q == kv_len:
            mask, is_causal = None, True  # plain prefill: top-left causal is the same thing
    uniform = all(q == max_q for q in q_lens)
    token_index = torch.cat([torch.arange(starts[i], starts[i] + batch.q_lens[i]) for i in reqs])
    if uniform:
        valid = None
    else:
        valid = (q_pos[None, :] < torch.tensor(q_lens)[:, None]).reshape(-1).to(device)
    return _Bucket(
        token_index=token_index.to(device), valid=valid,
        block_tables=tables.to(device), mask=mask, batch=len(reqs), max_q=max_q,
        kv_len=kv_len, is_causal=is_causal,
    )


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
                padded[b.valid] = qb
                qb = padded
            ob = _attend_bucket(qb, kv, b, scale)
            if b.valid is not None:
                ob = ob[b.valid]
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
