"""Static, padded passes: CUDA graphs for the decode / verify step and the DFlash draft pass.

Two passes of a step have shapes that repeat: the target pass of a step whose every request
adds at most ``max_q`` tokens (decode, verify windows of ``K + 1`` tokens, short prompt
chunks), which the FlashInfer backend attends as single-query *rows*; and the draft's pass
over query blocks of ``K + 1`` positions per proposing request. Such a pass is padded up to
the next size of a ladder (``GraphConfig.sizes``, in rows for the target and in blocks for the
draft): pad entries are queries at position 0 (token 0) whose K/V go to a block the engine
keeps out of the block manager and which attend to that block alone, so they never touch a
request's pages and never change a real entry's result (every operation of a pass is row-wise
or within one entry). Tokens and positions go into static device buffers; the backend's
graph metadata for that size plans its kernels outside the graph (FlashInfer ``plan`` copies
index arrays into fixed-size buffers); then the graph recorded for that size replays the pass.
Other passes (long prompt chunks, larger steps) run eagerly through the same model and pool.

``GraphConfig.capture=False`` runs the same static buffers and padding eagerly (no capture):
how the CPU tests that padding and static inputs give the tokens of the plain path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from attention.backends.base import AttentionBackend, AttentionBatch
from attention.backends.flashinfer_backend import ROW_MAX_Q  # the only target plan graphed
from attention.kv import LayerKV
from engine.config import GraphConfig

log = logging.getLogger("specserve.engine")


@dataclass(frozen=True)
class QueryShape:
    """What a backend plans a model's attention for, besides the batch."""

    num_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float


@dataclass(frozen=True)
class PadSpace:
    """Where pad entries live (one block no request owns) and how long a context can be."""

    block: int
    max_pages: int  # pages of the longest context (max_model_len plus look-ahead)


# a pass: (static ids, static positions, metadata) -> its output tensors
Forward = Callable[[torch.Tensor, torch.Tensor, object], tuple[torch.Tensor | None, ...]]


@dataclass
class _Graph:
    meta: object  # the backend's static metadata for this size (``prepare`` then ``attend``)
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor | None, ...]  # rewritten by every replay


class PaddedPasses:
    """One kind of pass run from static buffers, padded to a ladder of sizes.

    ``q_len == 1``: the target's rows; a size counts tokens, and a request may add up to
    ``max_q`` of them (causal batches). ``q_len > 1``: the draft's query blocks; a size counts
    blocks of exactly ``q_len`` queries (non-causal batches)."""

    def __init__(
        self,
        forward: Forward,
        kv: LayerKV,
        backend: AttentionBackend,
        device: torch.device,
        config: GraphConfig,
        pad: PadSpace,
        query: QueryShape,
        q_len: int = 1,
        name: str = "target",
    ) -> None:
        self.forward = forward
        self.kv = kv
        self.backend = backend
        self.device = device
        self.config = config
        self.pad_space = pad
        self.query = query
        self.q_len = q_len
        self.name = name
        self.block_size = kv.block_size
        self.max_q = getattr(backend, "row_max_q", ROW_MAX_Q) if q_len == 1 else q_len
        pages = -(-q_len // self.block_size)
        self.pad_table = (pad.block,) * pages
        self.pad_slots = [pad.block * self.block_size + j % self.block_size for j in range(q_len)]
        tokens = config.sizes[-1] * q_len
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self._graphs: dict[int, _Graph] = {}
        if config.capture:
            self.capture_all()

    @property
    def pad_slot(self) -> int:
        return self.pad_slots[0]

    def entries(self, batch: AttentionBatch) -> int:
        return batch.num_tokens if self.q_len == 1 else len(batch.q_lens)

    def fits(self, batch: AttentionBatch) -> bool:
        if batch.tree_masks is not None:  # tree verification steps run eagerly
            return False
        if not batch.q_lens or self.config.size_for(self.entries(batch)) is None:
            return False
        if self.q_len == 1:
            shape_ok = batch.causal and max(batch.q_lens) <= self.max_q
        else:
            shape_ok = not batch.causal and all(q == self.q_len for q in batch.q_lens)
        return shape_ok and all(-(-kv // self.block_size) <= self.pad_space.max_pages
                                for kv in batch.kv_lens)

    def pad(self, batch: AttentionBatch, size: int) -> AttentionBatch:
        """``batch`` with pad entries up to ``size`` (each: ``q_len`` queries over themselves,
        in the pad block)."""
        extra = size - self.entries(batch)
        if extra < 0:
            raise ValueError(f"a pass of {self.entries(batch)} entries does not fit size {size}")
        slots = batch.slot_mapping
        if extra:
            pad = torch.tensor(self.pad_slots * extra, dtype=slots.dtype)
            slots = torch.cat([slots, pad])
        q = self.q_len
        return AttentionBatch(batch.q_lens + (q,) * extra, batch.kv_lens + (q,) * extra,
                              batch.block_tables + (self.pad_table,) * extra, slots,
                              causal=batch.causal, block_size=batch.block_size)

    @torch.inference_mode()
    def run(
        self, ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor | None, ...]:
        """The pass of an eligible batch: its outputs for the real tokens only."""
        n = batch.num_tokens
        size = self.config.size_for(self.entries(batch))
        padded = self.pad(batch, size)
        tokens = size * self.q_len
        self._load_inputs(ids, positions, tokens)
        if not self.config.capture:
            meta = self.backend.build_metadata(padded, self.device)
            outputs = self.forward(self.ids[:tokens], self.positions[:tokens], meta)
        else:
            entry = self._graphs[size]
            entry.meta.prepare(padded)
            entry.graph.replay()
            outputs = entry.outputs
        return tuple(None if t is None else t[:n] for t in outputs)

    def _load_inputs(self, ids, positions, tokens: int) -> None:
        """Tokens and positions into the static buffers in one copy each (pad rows: zeros)."""
        host = torch.zeros(2, tokens, dtype=torch.long)
        n = len(ids)
        host[0, :n] = torch.as_tensor(ids, dtype=torch.long)
        host[1, :n] = torch.as_tensor(positions, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.ids[:tokens].copy_(host[0], non_blocking=True)
        self.positions[:tokens].copy_(host[1], non_blocking=True)

    # -- capture ---------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Record one graph per size, largest first, all in one memory pool (only one replays
        at a time, and its outputs are read before the next)."""
        make = getattr(self.backend, "graph_metadata", None)
        if make is None:
            raise ValueError(f"attention backend {self.backend.name!r} cannot be captured in "
                             "CUDA graphs")
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        causal = self.q_len == 1
        empty = AttentionBatch((), (), (), torch.zeros(0, dtype=torch.long), causal,
                               self.block_size)
        with torch.inference_mode():
            for size in reversed(self.config.sizes):
                meta = make(size, self.q_len, self.pad_space.max_pages, self.query, self.kv)
                meta.prepare(self.pad(empty, size))
                tokens = size * self.q_len
                self.ids[:tokens].zero_()
                self.positions[:tokens].zero_()
                args = (self.ids[:tokens], self.positions[:tokens], meta)
                self.forward(*args)  # warm-up: kernels chosen, workspaces allocated
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.forward(*args)
                self._graphs[size] = _Graph(meta, graph, outputs)
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs of the %s pass (%s %s) in %.1f s", len(self._graphs),
                 self.name, ", ".join(map(str, self.config.sizes)),
                 "tokens" if self.q_len == 1 else f"blocks of {self.q_len}",
                 time.perf_counter() - start)


def draft_sizes(config: GraphConfig, q_len: int) -> GraphConfig:
    """The draft's ladder: as many blocks as fit the target's largest step in tokens."""
    limit = max(1, config.sizes[-1] // q_len)
    sizes = tuple(s for s in config.sizes if s <= limit) or (1,)
    return GraphConfig(sizes, config.capture)


def target_passes(model, kv_layers: list[LayerKV], backend: AttentionBackend,
                  device: torch.device, config: GraphConfig, pad: PadSpace,
                  capture_layers: Sequence[int]) -> PaddedPasses:
    """The target's decode / verify passes (hidden states and the draft's taps)."""
    cfg = model.config
    query = QueryShape(cfg.num_heads, cfg.head_dim, model.embed_tokens.weight.dtype,
                       cfg.head_dim**-0.5)
    taps = tuple(capture_layers)

    def forward(ids, positions, meta):
        return model(ids, positions, meta, kv_layers, taps)

    return PaddedPasses(forward, kv_layers[0], backend, device, config, pad, query)
