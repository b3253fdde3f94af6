"""DFlash proposer: one non-causal draft pass per step proposes K tokens per request.

After the target pass, the tapped target states of every accepted position become draft
context K/V (written into the draft group's pages at those positions; a request's writes wait
until it drafts and land in one batch before its proposal reads the pages);
then the query block ``[last sampled token, MASK x K]`` at positions ``p..p+K`` goes to
look-ahead slots and attends to the whole context plus the block. A draft trained with
refinement passes (``dflash_config.refine_passes``) reruns the block with its own greedy
guesses in place of MASK. The draft is greedy; verification stays exact. A DFlash2 draft
(detected from its config.json) is served by ``engine/spec/dflash2.py``: the same pass, then
its candidate selector chooses the tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import torch

from attention.backends.base import AttentionBackend, AttentionBatch
from attention.groups import LayerKVSpec
from attention.kv import LayerKV, SlotIndex
from engine.config import ConfigError, EngineConfig, GraphConfig
from engine.graphs import PaddedPasses, PadSpace, QueryShape, draft_sizes
from engine.kv_pool import KVPool
from engine.runner import slot_list
from engine.spec.base import ProposalItem
from engine.spec.tree import (
    DraftTree,
    DraftWindow,
    TreeError,
    load_tree,
    slots_needed,
    unsupported,
)
from engine.spec.tree_order import ConfidenceOrder
from engine.request import Request
from models.dflash import (
    MASK_EMBEDDING_FILE,
    BlockRows,
    DFlashConfig,
    DFlashDraftModel,
    iter_draft_weights,
    refinement_inputs,
)
from models.dflash2 import DFlash2Config, build_draft, draft_config
from models.hf_folder import load_hf_config
from models.layers import argmax, linear, pack_weight
from models.llama import LlamaForCausalLM


# Context K/V of a request waits until the request drafts (a request that never drafts, as
# under load where verification does not pay, never costs a write); all of it is written at
# once when the waiting states exceed this many bytes.
MAX_PENDING_CONTEXT_BYTES = 64 * 2**20


class PendingContext:
    """Draft context K/V not yet written, per request: tapped target states of consecutive
    positions, in the order the steps produced them. Slots are looked up in the request's
    block table when the states are taken, so a finished or preempted request's states (its
    pages no longer its own) are dropped unwritten by :meth:`prune`.

    A step's states are kept whole and each request holds views of its rows (one copy per
    step instead of one per request); ``num_bytes`` counts every step some request still
    holds rows of, whole, since that is the memory held."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}
        self.num_bytes = 0

    @property
    def num_tokens(self) -> int:
        return sum(w.count for w in self._waiting.values())

    def add(self, req: Request, hidden: torch.Tensor, start: int) -> None:
        """The states ``hidden [n, taps*H]`` of positions ``start .. start+n-1`` of ``req``."""
        self.add_step(hidden, [(req, 0, start, hidden.shape[0])])

    def add_step(self, states: torch.Tensor, parts: list[tuple[Request, int, int, int]]) -> None:
        """One step's states ``[rows, taps*H]``, kept as given (not a buffer the caller
        reuses), and per request ``(request, first row, first position, count)``."""
        step = _Step(states)
        for req, row, start, count in parts:
            w = self._waiting.get(req.request_id)
            if w is not None and (w.request is not req or req.num_preemptions != w.preemptions):
                self._drop(req.request_id)  # computed before a preemption (or for a namesake)
                w = None
            if w is None:
                w = self._waiting[req.request_id] = _Waiting(req, req.num_preemptions, start)
            elif start != w.start + w.count:
                raise ValueError(f"context of {req.request_id!r} at {start}, expected "
                                 f"{w.start + w.count}")
            w.parts.append((step, row, count))
            w.count += count
            step.holders += 1
        if step.holders:
            self.num_bytes += step.num_bytes

    def prune(self) -> None:
        """Drop the states of requests that finished or were preempted since they were added."""
        gone = [rid for rid, w in self._waiting.items()
                if w.request.is_finished or w.request.num_preemptions != w.preemptions]
        for rid in gone:
            self._drop(rid)

    def take(self, block_size: int, request_ids: list[str] | None = None
             ) -> tuple[torch.Tensor, list[int], list[int]] | None:
        """The waiting states of ``request_ids`` (default: all) with their positions and
        slots, removed; None if there are none."""
        rids = list(self._waiting) if request_ids is None else [
            r for r in request_ids if r in self._waiting]
        if not rids:
            return None
        hidden: list[torch.Tensor] = []
        pos: list[int] = []
        slots: list[int] = []
        for rid in rids:
            w = self._drop(rid)
            hidden.extend(step.states[row:row + n] for step, row, n in w.parts)
            pos.extend(range(w.start, w.start + w.count))
            slots.extend(slot_list(w.request.block_table, w.start, w.start + w.count, block_size))
        return (hidden[0] if len(hidden) == 1 else torch.cat(hidden)), pos, slots

    def _drop(self, rid: str) -> _Waiting:
        w = self._waiting.pop(rid)
        for step, _, _ in w.parts:
            step.holders -= 1
            if not step.holders:
                self.num_bytes -= step.num_bytes
        return w


class _Step:
    """One step's tapped states, shared by the requests holding rows of them."""

    __slots__ = ("states", "num_bytes", "holders")

    def __init__(self, states: torch.Tensor) -> None:
        self.states = states
        self.num_bytes = states.numel() * states.element_size()
        self.holders = 0


@dataclasses.dataclass
class _Waiting:
    request: Request
    preemptions: int  # the request's count when these states were computed
    start: int  # position of the first state
    count: int = 0
    parts: list[tuple[_Step, int, int]] = dataclasses.field(default_factory=list)


class DFlashProposer:
    trims_blocks = True  # whether a request's proposal may run only the block rows it needs

    def __init__(
        self,
        draft: DFlashDraftModel,
        target: LlamaForCausalLM,
        num_speculative_tokens: int,
        cache_dtype: str,
        block_size: int,
        device: torch.device,
        tree: DraftTree | None = None,
    ) -> None:
        self.draft = draft
        self.target = target
        self.num_speculative_tokens = num_speculative_tokens
        # the drafts offered per step: the tree's nodes (engine.spec.tree), else a chain of K
        self.tree = tree
        self.num_drafts = tree.num_nodes if tree is not None else num_speculative_tokens
        # Per draft: its block slot (1-based) and its rank among the slot's candidates (a
        # chain is the tree of rank-0 nodes); a [slots, ranks] table of each block's top tokens
        # holds draft j at cell (slot - 1) * width + rank. The first n drafts need the first
        # rows_for[n] slots.
        shape = tree if tree is not None else DraftTree.chain(num_speculative_tokens)
        self._width = shape.max_rank + 1
        self._cells = [(d - 1) * self._width + r for d, r in zip(shape.depths, shape.ranks)]
        self._rows_for = slots_needed(shape, shape.num_nodes)
        # a tree ordered per block by the draft's confidence (engine.spec.tree_order); the
        # windows of the last propose(): each request's drafts' tree and confidence
        self._order = ConfidenceOrder(tree) if tree is not None and tree.dynamic else None
        self.windows: dict[str, DraftWindow] = {}
        # A request that wants its first few drafts gets the block rows they need alone
        # (models.dflash.BlockRows: the last layer runs only those rows' queries, projection
        # and MLP, and the head scores only them). On the CPU, whose paged attention kernel is
        # query-length invariant, so every draft is bitwise the whole block's; not with
        # refinement passes (they rerun the whole block) or a DFlash2 selector (it reads the
        # whole block).
        self._trim_rows = (self.trims_blocks and device.type == "cpu"
                           and draft.config.refine_passes == 0)
        self.capture_layers = tuple(draft.config.target_layer_ids)
        self.lookahead_slots = num_speculative_tokens + 1  # the next block: p .. p+K
        self.cache_dtype = cache_dtype
        self.block_size = block_size
        self.device = device
        self.layer_names = [f"draft.{name}" for name in draft.layer_names]
        self._kv: list[LayerKV] | None = None
        self._backend: AttentionBackend | None = None
        self._graphs: PaddedPasses | None = None  # static block passes (CUDA graphs)
        self._pending = PendingContext()
        self.max_pending_context_bytes = MAX_PENDING_CONTEXT_BYTES
        self.draft_seconds = 0.0
        # The rows of the target's LM head the draft scores (all of them, or its reduced
        # vocabulary) and their target ids; selected once here, not per step.
        self._vocab_ids = draft.draft_token_ids
        self._vocab_list = None if self._vocab_ids is None else self._vocab_ids.tolist()
        head = target.lm_head_weight
        self._head = head if self._vocab_ids is None else head.index_select(0, self._vocab_ids)
        # packed for the CPU's GEMM like the target's head (the full head: the target's copy)
        self._head_packed = (target.head_packed if self._vocab_ids is None
                             else pack_weight(self._head))

    @classmethod
    def create(
        cls, config: EngineConfig, target: LlamaForCausalLM, device: torch.device
    ) -> DFlashProposer:
        spec = config.speculative
        path = Path(spec.model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"speculative_config.model {spec.model!r} is not a folder with config.json",
                "speculative_config.model",
            )
        dcfg = draft_config(load_hf_config(path))
        if spec.method == "dflash2" and not isinstance(dcfg, DFlash2Config):
            raise ConfigError(
                f"speculative_config.method 'dflash2' needs a DFlash2 draft; {spec.model!r} is a "
                "DFlash draft (use method 'dflash', which detects the kind)",
                "speculative_config.method",
            )
        validate_draft(dcfg, target, has_mask_embedding=_has_mask_embedding(path))
        k = spec.num_speculative_tokens or dcfg.block_size - 1
        if not 1 <= k <= dcfg.block_size - 1:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens must be in [1, {dcfg.block_size - 1}] "
                f"for a draft with block_size {dcfg.block_size}, got {k}",
                "speculative_config.num_speculative_tokens",
            )
        # The draft is built under a copy of the cache config with its own dtype; the layout
        # cell is shared with the original, so the layout resolved later is seen by both.
        draft_cache = dataclasses.replace(
            config.cache, cache_dtype=spec.kv_cache_dtype or config.cache.cache_dtype
        )
        max_positions = target.rotary.max_positions
        with torch.device(device):
            draft = build_draft(dcfg, max_positions)
        draft = draft.to(dtype=config.model.dtype).eval().requires_grad_(False)
        draft.load_weights(iter_draft_weights(path))
        validate_draft_vocab(draft, target)
        draft.pack_weights(target.min_rows, target.products)
        args = (draft, target, k, draft_cache.cache_dtype, draft_cache.block_size, device)
        if isinstance(dcfg, DFlash2Config):
            if spec.tree not in (None, "chain"):
                raise ConfigError(
                    "speculative_config.tree is not supported with a DFlash2 draft (its selector "
                    "samples one chain); drop the key", "speculative_config.tree")
            from engine.spec.dflash2 import DFlash2Proposer

            return DFlash2Proposer(*args, seed=config.model.seed)
        try:
            tree = load_tree(spec.tree, spec.model, k,
                             unsupported(config.attention_backend),
                             dynamic=spec.tree_order == "confidence")
        except TreeError as exc:
            raise ConfigError(f"speculative_config.tree: {exc}", "speculative_config.tree") from exc
        return cls(*args, tree=tree)

    # -- engine wiring ---------------------------------------------------------------------
    def layer_specs(self) -> list[LayerKVSpec]:
        c = self.draft.config
        return [
            LayerKVSpec(name, "draft", c.num_kv_heads, c.head_dim, self.cache_dtype, self.block_size)
            for name in self.layer_names
        ]

    def bind(self, pool: KVPool, backend: AttentionBackend | None) -> None:
        """Receive the draft layers' pages (layout and dtype come from the pool) and backend."""
        self._kv = pool.layers(self.layer_names)
        self._backend = backend

    def use_graphs(self, config: GraphConfig, pad: PadSpace) -> None:
        """Run the block pass from static buffers, replaying a CUDA graph per number of
        proposing requests (``engine.graphs``; after :meth:`bind`)."""
        c = self.draft.config
        q_len = self.num_speculative_tokens + 1
        query = QueryShape(c.num_heads, c.head_dim, self.draft.norm.weight.dtype,
                           c.head_dim**-0.5)
        self._graphs = PaddedPasses(self._block_pass, self._kv[0], self._backend, self.device,
                                    draft_sizes(config, q_len), pad, query, q_len, "draft")

    # -- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self, items: list[ProposalItem], captured: torch.Tensor | None
    ) -> dict[str, list[int]]:
        if self._kv is None or self._backend is None:
            raise RuntimeError("DFlashProposer.bind() must be called before propose()")
        if captured is None:
            raise RuntimeError("DFlash needs the target's tapped hidden states")
        bs = self.block_size
        k = self.num_speculative_tokens
        # index lists are built in Python and turned into tensors once per step
        ctx: list[tuple[Request, int, int, int]] = []  # request, first row, first position, count
        block_ids: list[int] = []
        block_pos: list[int] = []
        block_slots: list[int] = []
        kv_lens, tables = [], []
        counts: list[int] = []  # drafts each proposing request wants
        mask_id = self.draft.config.mask_token_id
        proposing: list[Request] = []
        for it in items:
            req = it.item.request
            if it.num_valid > 0:
                ctx.append((req, it.row, it.start, it.num_valid))
            if not it.sampled or not it.num_drafts:
                continue
            p = it.start + it.num_valid  # position of the newest (bonus) token
            proposing.append(req)
            counts.append(min(it.num_drafts, self.num_drafts))
            block_ids.append(it.sampled[-1])
            block_ids.extend([mask_id if mask_id is not None else 0] * k)
            block_pos.extend(range(p, p + k + 1))
            block_slots.extend(slot_list(req.block_table, p, p + k + 1, bs))
            kv_lens.append(p + k + 1)
            tables.append(tuple(req.block_table))

        pending = self._pending
        pending.prune()
        if ctx:
            # one copy of the step's states (the runner may hand a buffer it reuses)
            pending.add_step(captured.clone(), ctx)
        if pending.num_bytes > self.max_pending_context_bytes:
            self._write_context(pending.take(bs))
        self.draft_seconds = 0.0
        self.windows = {}
        if not proposing:
            return {}
        self._write_context(pending.take(bs, [r.request_id for r in proposing]))
        t0 = time.perf_counter()
        n = len(proposing)
        batch = AttentionBatch(
            q_lens=(k + 1,) * n, kv_lens=tuple(kv_lens), block_tables=tuple(tables),
            slot_mapping=torch.tensor(block_slots, dtype=torch.long), causal=False,
            block_size=bs,
        )
        if self._trim_rows and self._graphs is None:
            rows = [self._rows_for[c] for c in counts]
            hidden = self._rows_pass(self._index(block_ids), self._index(block_pos), batch, rows)
            drafts = self.choose_rows(proposing, hidden, rows, counts)
        else:
            if self._graphs is not None and self._graphs.fits(batch):
                hidden, = self._graphs.run(block_ids, block_pos, batch)
            else:
                meta = self._backend.build_metadata(batch, self.device)
                hidden, = self._block_pass(self._index(block_ids), self._index(block_pos), meta)
            anchors = self._index(block_ids[:: k + 1])
            whole = self.choose(proposing, hidden.view(n, k + 1, -1), anchors)  # on the host
            # (a tree laid out per block keeps every node: every slot was scored)
            drafts = whole if self._order is not None else {
                r.request_id: whole[r.request_id][:c] for r, c in zip(proposing, counts)}
        self.draft_seconds = time.perf_counter() - t0
        return drafts

    def _embed_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Inputs of the query blocks ``[token, MASK x K]``: the target's embedding, with the
        draft's own mask embedding in the MASK slots if it has one."""
        embeds = self.target.embed(ids)
        if self.draft.mask_embedding is not None:
            q_len = self.num_speculative_tokens + 1
            embeds = embeds.view(-1, q_len, embeds.shape[-1]).clone()
            embeds[:, 1:] = self.draft.mask_embedding.to(embeds.dtype)
            embeds = embeds.view(ids.shape[0], -1)
        return embeds

    def _rows_pass(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                   rows: list[int]) -> torch.Tensor:
        """The draft's states ``[sum(rows), H]`` of the first ``rows[i]`` drafted slots of
        block ``i`` (``models.dflash.BlockRows``), the blocks laid out as ``batch`` says."""
        q_len = self.num_speculative_tokens + 1
        keep = [i * q_len + 1 + j for i, r in enumerate(rows) for j in range(r)]
        index = self._index(keep)
        slots = batch.slot_mapping
        kept = dataclasses.replace(batch, q_lens=tuple(rows),
                                   slot_mapping=slots.index_select(0, index.to(slots.device)))
        backend = self._backend
        block_rows = BlockRows(index, backend.build_metadata(kept, self.device),
                               SlotIndex.build(slots, batch.block_size, self.device))
        # the layers before the last run every row (none in a one-layer draft)
        meta = backend.build_metadata(batch, self.device) if len(self.layer_names) > 1 else None
        return self.draft(self._embed_blocks(ids), positions, meta, self._kv, block_len=q_len,
                          rows=block_rows)

    def _block_pass(self, ids: torch.Tensor, positions: torch.Tensor, meta
                    ) -> tuple[torch.Tensor]:
        """The draft's states ``[n*(K+1), H]`` for query blocks ``[token, MASK x K]``; a draft
        trained with refinement passes then reruns each block with its greedy guesses in place
        of MASK (same positions and slots: the block's K/V are overwritten, the context's stay),
        all on the device, so a CUDA graph captures every pass."""
        q_len = self.num_speculative_tokens + 1
        embeds = self._embed_blocks(ids)
        hidden = self.draft(embeds, positions, meta, self._kv, block_len=q_len)
        cfg = self.draft.config
        masks = embeds.view(-1, q_len, embeds.shape[-1])[:, 1:]
        for _ in range(cfg.refine_passes):
            blocks = hidden.view(-1, q_len, hidden.shape[-1])
            logits = self.draft_logits(blocks[:, 1:].reshape(-1, hidden.shape[-1]))
            embeds = embeds.view(blocks.shape[0], q_len, -1).clone()
            embeds[:, 1:] = refinement_inputs(logits.view(*masks.shape[:2], -1), masks,
                                              self._vocab_ids, self.target.embed,
                                              cfg.refine_threshold)
            embeds = embeds.view(ids.shape[0], -1)
            hidden = self.draft(embeds, positions, meta, self._kv, block_len=q_len)
        return (hidden,)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _write_context(self, taken: tuple[torch.Tensor, list[int], list[int]] | None) -> None:
        if taken is not None:
            hidden, pos, slots = taken
            self.draft.write_context(hidden, self._index(pos), self._index(slots), self._kv)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores ``[N, V']`` of the draft's vocabulary for final-normed draft states ``[N, H]``."""
        return linear(hidden, self._head, packed=self._head_packed, min_rows=self.target.min_rows)

    def choose(
        self, reqs: list[Request], hidden: torch.Tensor, anchors: torch.Tensor
    ) -> dict[str, list[int]]:
        """Every draft from the whole block states ``[n, K+1, H]`` (:meth:`choose_rows` over
        the slots the drafts need; DFlash2 overrides this with its selector)."""
        n, rows = hidden.shape[0], self._rows_for[-1]
        states = hidden[:, 1:rows + 1].reshape(n * rows, -1)
        return self.choose_rows(reqs, states, [rows] * n, [self.num_drafts] * n)

    def choose_rows(self, reqs: list[Request], hidden: torch.Tensor, rows: list[int],
                    counts: list[int]) -> dict[str, list[int]]:
        """The first ``counts[i]`` drafts of request ``i`` from the states of its first
        ``rows[i]`` drafted slots (``hidden [sum(rows), H]``, in request order): a chain's draft
        is its slot's argmax, a tree node the ``rank``-th best token of its slot."""
        width = self._width
        logits = self.draft_logits(hidden)
        if self._order is not None:
            return self._choose_ordered(reqs, logits, rows)
        top = argmax(logits) if width == 1 else logits.topk(width, dim=-1).indices.view(-1)
        pick: list[int] = []
        first = 0
        for r, c in zip(rows, counts):
            pick.extend(first * width + cell for cell in self._cells[:c])
            first += r
        tokens = top.index_select(0, self._index(pick))
        if self._vocab_ids is not None:
            tokens = self._vocab_ids.index_select(0, tokens)
        flat = tokens.tolist()  # on the host
        drafts: dict[str, list[int]] = {}
        first = 0
        for req, c in zip(reqs, counts):
            drafts[req.request_id] = flat[first:first + c]
            first += c
        return drafts

    def _choose_ordered(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]
                        ) -> dict[str, list[int]]:
        """:meth:`choose_rows` for a tree laid out per block (``engine.spec.tree_order``):
        request ``i``, whose drafts asked for ``rows[i]`` scored slots, gets every node those
        slots hold, most confident first (the slots are paid for, the
        choice of tokens costs microseconds, and the controller verifies only the ones its
        block is confident enough in), their windows in :attr:`windows`."""
        assert self._order is not None
        top = logits.topk(self._width, dim=-1)
        logp = top.values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        scores, ids = logp.tolist(), top.indices.tolist()  # on the host: a few rows each
        vocab = self._vocab_list
        drafts: dict[str, list[int]] = {}
        first = 0
        for req, r in zip(reqs, rows):
            _, window, cells = self._order.order(scores[first:first + r], r, self._order.within[r])
            picked = [ids[first + slot][rank] for slot, rank in cells]
            drafts[req.request_id] = picked if vocab is None else [vocab[t] for t in picked]
            self.windows[req.request_id] = window
            first += r
        return drafts


def validate_draft_vocab(draft: DFlashDraftModel, target: LlamaForCausalLM) -> None:
    ids = draft.draft_token_ids
    vocab = target.config.vocab_size
    # the ids ascend from >= 0 (checked on load), so the last one in range bounds them all
    if ids is not None and int(ids[-1]) >= vocab:
        raise ConfigError(
            f"Draft d2t maps to target id {int(ids[-1])}, outside the target's vocabulary "
            f"[0, {vocab - 1}]",
            "speculative_config.model",
        )


def _has_mask_embedding(path: Path) -> bool:
    return (path / MASK_EMBEDDING_FILE).is_file()


def validate_draft(cfg: DFlashConfig, target: LlamaForCausalLM, has_mask_embedding: bool) -> None:
    """Startup checks of a draft against its target; each names the field and allowed values."""
    t = target.config
    if cfg.hidden_size != t.hidden_size:
        raise ConfigError(
            f"Draft hidden_size {cfg.hidden_size} differs from the target's {t.hidden_size}; "
            "a DFlash draft shares the target's embedding and LM head, so they must be equal",
            "speculative_config.model",
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_layers]
    if bad or not cfg.target_layer_ids:
        raise ConfigError(
            f"Draft dflash_config.target_layer_ids {list(cfg.target_layer_ids)} must be non-empty "
            f"with ids in [0, {t.num_layers - 1}] (the target has {t.num_layers} layers)",
            "speculative_config.model",
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"Draft num_attention_heads ({cfg.num_heads}) must be divisible by "
            f"num_key_value_heads ({cfg.num_kv_heads})",
            "speculative_config.model",
        )
    if cfg.block_size < 2:
        raise ConfigError(f"Draft block_size must be >= 2, got {cfg.block_size}",
                          "speculative_config.model")
    if not has_mask_embedding:
        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < t.vocab_size:
            raise ConfigError(
                f"Draft dflash_config.mask_token_id {cfg.mask_token_id} must be in "
                f"[0, {t.vocab_size - 1}] (the target's vocabulary), or the draft must ship "
                f"{MASK_EMBEDDING_FILE}",
                "speculative_config.model",
            )
