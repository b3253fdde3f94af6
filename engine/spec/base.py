"""The proposer interface the runner calls after verification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.outputs import ScheduledRequest
from engine.spec.tree import DraftTree, DraftWindow


@dataclass
class ProposalItem:
    """One scheduled request after this step's target pass.

    ``start`` is the first position run this step and ``num_valid`` how many of the run
    positions hold accepted tokens (a prefill chunk: all of them; a verify window: the last
    token plus the accepted drafts). ``row`` is the request's first row in the packed batch.
    ``sampled`` are the tokens appended this step (empty while a prefill is in flight).
    """

    item: ScheduledRequest
    start: int
    num_valid: int
    row: int
    sampled: list[int]
    # the scheduler's choice: drafts to make for the next step (a proposer makes at most this
    # many and may stop short of it, except one laying out each block's tree, which makes
    # every node the slots of that many hold, engine.spec.tree_order); 0: update the draft
    # context only
    num_drafts: int


class Proposer(Protocol):
    num_speculative_tokens: int  # draft positions (the deepest draft)
    num_drafts: int  # drafts offered per step: K for a chain, the nodes of a tree
    tree: DraftTree | None  # engine.spec.tree; None: a chain
    capture_layers: tuple[int, ...]  # target layer ids whose outputs the proposer reads
    lookahead_slots: int  # extra KV slots a request needs past its length
    # seconds the last propose() spent drafting, apart from keeping the draft's context (the
    # controller prices drafting from it; catching up a context deferred over many plain steps
    # is owed by those steps, not by the choice to draft now)
    draft_seconds: float
    # the last propose()'s drafts laid out as their own block's tree, not in the tree's fixed
    # order (engine.spec.tree_order), per request
    windows: dict[str, DraftWindow]

    def use_graphs(self, config, pad) -> None:
        """Run the proposer's model passes from static buffers (``engine.graphs``), if any."""
        ...

    def propose(
        self, items: list[ProposalItem], captured: torch.Tensor | None
    ) -> dict[str, list[int]]:
        """Return draft tokens for each request that sampled this step."""
        ...
