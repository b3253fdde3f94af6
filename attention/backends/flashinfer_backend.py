"""FlashInfer attention backend for CUDA GPUs (``pip install specserve[gpu]``).

Per group and step one plan: the decode wrapper for causal single-token steps, the prefill
wrapper otherwise (``causal=True`` for target prefill/verify, ``causal=False`` for the DFlash
query block). ``kv_layout`` is the pool's resolved layout, read from the layer's ``LayerKV``
(never from a config copy); the KV data type is the group's; the query dtype is the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attention.backends.base import AttentionBatch
from attention.backends.paged_indices import PagedIndices, build_paged_indices
from attention.dtypes import dtype_name
from attention.kv import LayerKV, SlotIndex, write_kv

HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
WORKSPACE_BYTES = 128 << 20


class FlashInferBackend:
    name = "flashinfer"
    supported_layouts = ("NHD", "HND")

    def __init__(self, device: torch.device) -> None:
        import flashinfer  # lazy: only on CUDA machines with the extra installed

        self._fi = flashinfer
        self.device = device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, object] = {}

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

    def wrapper(self, kind: str, layout: str):
        """One wrapper per (kind, layout), sharing the backend's workspace."""
        key = (kind, layout)
        if key not in self._wrappers:
            if kind == "decode":
                self._wrappers[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, layout, use_tensor_cores=True
                )
            else:
                self._wrappers[key] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, layout
                )
        return self._wrappers[key]

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> FlashInferMetadata:
        decode = batch.causal and all(q == 1 for q in batch.q_lens)
        return FlashInferMetadata(
            backend=self,
            indices=build_paged_indices(batch).to(device),
            slots=SlotIndex.build(batch.slot_mapping.to(device), batch.block_size),
            causal=batch.causal,
            decode=decode,
        )


@dataclass
class FlashInferMetadata:
    backend: FlashInferBackend
    indices: PagedIndices
    slots: SlotIndex
    causal: bool
    decode: bool
    _planned: tuple | None = field(default=None)

    def _plan(self, q: torch.Tensor, kv: LayerKV, scale: float):
        key = (kv.layout, kv.dtype, q.dtype, q.shape[1], kv.group.num_kv_heads, q.shape[2], scale)
        kind = "decode" if self.decode else "prefill"
        wrapper = self.backend.wrapper(kind, kv.layout)
        if self._planned == key:
            return wrapper
        idx = self.indices
        heads, kv_heads, dim = q.shape[1], kv.group.num_kv_heads, q.shape[2]
        if self.decode:
            wrapper.plan(
                idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len, heads, kv_heads, dim,
                idx.page_size, pos_encoding_mode="NONE", q_data_type=q.dtype,
                kv_data_type=kv.dtype, sm_scale=scale,
            )
        else:
            wrapper.plan(
                idx.qo_indptr, idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len, heads,
                kv_heads, dim, idx.page_size, causal=self.causal, q_data_type=q.dtype,
                kv_data_type=kv.dtype, sm_scale=scale,
            )
        self._planned = key
        return wrapper

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float
    ) -> torch.Tensor:
        write_kv(kv, k, v, self.slots)
        wrapper = self._plan(q, kv, scale)
        return wrapper.run(q.contiguous(), kv.physical, k_scale=kv.k_scale, v_scale=kv.v_scale)
