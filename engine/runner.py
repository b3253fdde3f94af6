"""The model runner: turns a ``StepPlan`` into one target pass, sampling and proposals."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from attention.backends.base import AttentionBackend, AttentionBatch
from attention.kv import LayerKV
from engine.graphs import PaddedPasses
from engine.outputs import ScheduledRequest, StepPlan, StepResult
from engine.sampler import RowGroup, Sampler
from engine.spec.base import ProposalItem, Proposer
from engine.spec.tree import window_depths, window_masks
from models.llama import LlamaForCausalLM


def slot_list(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slot of each position in ``[start, end)``: ``table[p // bs] * bs + p % bs``.

    Plain Python: a step builds one tensor from all requests' slots instead of a few small
    tensor ops per request."""
    return slot_list_at(table, range(start, end), block_size)


def slot_list_at(table: list[int], positions: Iterable[int], block_size: int) -> list[int]:
    """Slot of each of ``positions`` (any order)."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def copy_slots(kv_layers: list[LayerKV], src: list[int], dst: list[int],
               device: torch.device) -> None:
    """Copy the K/V of slots ``src`` to slots ``dst`` in every layer (all sources are read
    before any destination is written)."""
    bs = kv_layers[0].block_size
    s = torch.tensor(src, dtype=torch.long, device=device)
    d = torch.tensor(dst, dtype=torch.long, device=device)
    sb, so, db, do = s // bs, s % bs, d // bs, d % bs
    for kv in kv_layers:
        pages = kv.logical  # [blocks, 2, bs, H, D] (a view in either layout)
        pages[db, :, do] = pages[sb, :, so]


def slots_for(table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    return torch.tensor(slot_list(table, start, end, block_size), dtype=torch.long)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_layers: list[LayerKV],
        backend: AttentionBackend,
        device: torch.device,
        sampler: Sampler,
        proposer: Proposer | None = None,
        graphs: PaddedPasses | None = None,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.device = device
        self.sampler = sampler
        self.proposer = proposer
        self.block_size = kv_layers[0].block_size
        self.graphs = graphs  # static, padded decode/verify passes (CUDA graphs)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan exactly as scheduled: which drafts are verified and which requests
        draft next were decided by the scheduler."""
        t0 = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens, kv_lens, tables = [], [], []
        groups: list[RowGroup] = []
        logit_rows: list[int] = []
        row_of: dict[str, int] = {}
        masks: list[int] | None = None  # attention tree masks, once a tree window is seen
        for item in plan.scheduled:
            req = item.request
            start, n = req.num_computed_tokens, item.num_new_tokens
            known = n - len(item.spec_token_ids)
            row_of[req.request_id] = len(ids)
            ids.extend(req.tokens(start, start + known) + item.spec_token_ids)
            parents = item.spec_parents
            if parents is None:
                positions.extend(range(start, start + n))
            else:
                # a tree window: node j at the root's position plus its depth, in slot
                # root + j; it sees its ancestors (engine.spec.tree)
                root = start + known - 1
                positions.extend(range(start, root))
                positions.extend(root + d for d in window_depths(parents))
                if masks is None:
                    masks = [0] * (len(ids) - n)
                masks.extend([0] * (known - 1) + window_masks(parents, known - 1))
            if masks is not None and parents is None:
                masks.extend([0] * n)
            slots.extend(slot_list(req.block_table, start, start + n, self.block_size))
            q_lens.append(n)
            kv_lens.append(start + n)
            tables.append(tuple(req.block_table))
            if item.samples:
                first = len(ids) - len(item.spec_token_ids) - 1
                groups.append(RowGroup(req, len(logit_rows), list(item.spec_token_ids),
                                       parents))
                logit_rows.extend(range(first, len(ids)))

        batch = AttentionBatch(
            q_lens=tuple(q_lens), kv_lens=tuple(kv_lens), block_tables=tuple(tables),
            slot_mapping=torch.tensor(slots, dtype=torch.long), causal=True,
            block_size=self.block_size,
            tree_masks=None if masks is None else torch.tensor(masks, dtype=torch.long),
        )
        capture = self.proposer.capture_layers if self.proposer is not None else ()
        hidden, captured = self.run_target(ids, torch.tensor(positions, dtype=torch.long), batch,
                                           capture)
        result = StepResult(sampled={})
        if groups:
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            for rid, res in self.sampler(logits, groups).items():
                result.sampled[rid] = res.tokens
                result.num_accepted[rid] = res.num_accepted
                if res.path is not None:
                    result.accepted_paths[rid] = res.path
                if res.logprobs is not None:
                    result.logprobs[rid] = res.logprobs
            if masks is not None:
                captured = self._keep_paths(plan, row_of, result, captured)
        if self.proposer is not None:
            items = [self._proposal_item(item, row_of, result) for item in plan.scheduled]
            result.drafts = self.proposer.propose(items, captured)
            result.draft_windows = self.proposer.windows
            result.draft_elapsed = self.proposer.draft_seconds
        result.elapsed = time.perf_counter() - t0
        return result

    def run_target(
        self, ids: list[int], positions: torch.Tensor, batch: AttentionBatch,
        capture: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass (tensor parallelism overrides this to send it to every rank)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(ids, positions, batch)
        meta = self.backend.build_metadata(batch, self.device)
        return self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            positions.to(self.device),
            meta,
            self.kv_layers,
            capture,
        )

    def _keep_paths(self, plan: StepPlan, row_of: dict[str, int], result: StepResult,
                    captured: torch.Tensor | None) -> torch.Tensor | None:
        """Move each tree window's accepted nodes to the slots (and captured rows) of their
        depths, so the request's K/V and its draft context read as a chain from here on.
        Nodes already at their depth (the first branch) stay where they are."""
        src_slots: list[int] = []
        dst_slots: list[int] = []
        src_rows: list[int] = []
        dst_rows: list[int] = []
        for item in plan.scheduled:
            path = result.accepted_paths.get(item.request_id, [])
            moved = [(d, j) for d, j in enumerate(path, start=1) if d != j]
            if not moved:
                continue
            req = item.request
            root = req.num_computed_tokens + item.num_new_tokens - len(item.spec_token_ids) - 1
            row = row_of[item.request_id] + root - req.num_computed_tokens
            src_slots += slot_list_at(req.block_table, [root + j for _, j in moved],
                                      self.block_size)
            dst_slots += slot_list_at(req.block_table, [root + d for d, _ in moved],
                                      self.block_size)
            src_rows += [row + j for _, j in moved]
            dst_rows += [row + d for d, _ in moved]
        if not src_slots:
            return captured
        self.move_slots(src_slots, dst_slots)
        if captured is not None:
            src = torch.tensor(src_rows, dtype=torch.long, device=captured.device)
            dst = torch.tensor(dst_rows, dtype=torch.long, device=captured.device)
            captured = captured.index_copy(0, dst, captured.index_select(0, src))
        return captured

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the target's K/V of slots ``src`` to ``dst`` (tensor parallelism overrides
        this to have every rank move its own heads)."""
        copy_slots(self.kv_layers, src, dst, self.device)

    @staticmethod
    def _proposal_item(
        item: ScheduledRequest, row_of: dict[str, int], result: StepResult
    ) -> ProposalItem:
        rid = item.request_id
        return ProposalItem(
            item=item,
            start=item.request.num_computed_tokens,
            num_valid=item.num_valid(result.num_accepted.get(rid, 0)),
            row=row_of[rid],
            sampled=result.sampled.get(rid, []),
            num_drafts=item.draft,
        )
