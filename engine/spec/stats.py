"""Speculative decoding statistics with vLLM's names and meaning."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # how often a sampling request verified k drafts, k = 0..max_verified (0: a plain decode)
    num_steps_by_k: list[int] = field(default_factory=list)
    # drafts a window can verify: num_spec_tokens for a chain, the nodes of a tree (whose
    # accepted tokens still count per position, at most num_spec_tokens deep)
    max_verified: int | None = None

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        if not self.num_steps_by_k:
            self.num_steps_by_k = [0] * ((self.max_verified or self.num_spec_tokens) + 1)

    def observe_choice(self, k: int) -> None:
        self.num_steps_by_k[k] += 1

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one verified draft of ``num_draft_tokens`` with ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (the bonus token included), 1.0 before any draft."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [c / self.num_drafts if self.num_drafts else 0.0
                for c in self.num_accepted_tokens_per_pos]
