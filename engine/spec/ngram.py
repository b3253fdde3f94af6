"""Prompt-lookup (n-gram) proposer: no model, drafts copied from earlier context."""

from __future__ import annotations

import time

import torch

from engine.spec.base import ProposalItem


class NgramProposer:
    capture_layers: tuple[int, ...] = ()
    lookahead_slots = 0

    def __init__(self, num_speculative_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.num_drafts = num_speculative_tokens
        self.tree = None  # prompt lookup offers one chain
        self.min_n, self.max_n = min_n, max_n
        self.draft_seconds = 0.0
        self.windows: dict = {}  # chains only (engine.spec.base.Proposer.windows)

    def layer_specs(self) -> list:
        return []

    def bind(self, pool, backend) -> None:
        return None

    def use_graphs(self, config, pad) -> None:
        """Nothing to capture: n-gram drafts are looked up on the host."""
        return None

    def propose(
        self, items: list[ProposalItem], captured: torch.Tensor | None
    ) -> dict[str, list[int]]:
        t0 = time.perf_counter()
        drafts = {}
        for it in items:
            if not it.sampled or not it.num_drafts:
                continue
            req = it.item.request
            context = req.prompt_token_ids + req.output_token_ids + it.sampled
            found = lookup(context, self.min_n, self.max_n,
                           min(it.num_drafts, self.num_speculative_tokens))
            if found:
                drafts[req.request_id] = found
        self.draft_seconds = time.perf_counter() - t0
        return drafts


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Find the longest suffix n-gram (``max_n`` down to ``min_n``) seen earlier; return up to
    ``k`` tokens that followed its most recent earlier occurrence."""
    n_tokens = len(tokens)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = tokens[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []
