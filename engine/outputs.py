"""Plain dataclasses passed between scheduler, runner and callers (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request
    from engine.spec.tree import DraftWindow


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-N alternatives (token id -> logprob)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_new_tokens: int = 0  # tokens appended in the step that produced this output
    metrics: dict = field(default_factory=dict)


@dataclass
class ScheduledRequest:
    """What the scheduler decided for one request this step; the runner only carries it out."""

    request: Request
    num_new_tokens: int  # tokens run through the target this step (spec tokens included)
    spec_token_ids: list[int]  # draft tokens being verified (the tail of the scheduled tokens)
    draft: int = 0  # drafts to propose for the next step, if a token is sampled (0: none)
    # a tree of drafts (engine.spec.tree): spec_parents[j - 1] is the window row of draft j's
    # parent (0: the last known token); None: a chain, each draft's parent the one before it
    spec_parents: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def num_valid(self, num_accepted: int) -> int:
        """Positions run this step that hold accepted tokens: the known tokens plus the
        accepted drafts (the rejected tail is rolled back)."""
        return self.num_new_tokens - len(self.spec_token_ids) + num_accepted

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a token is sampled."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) >= req.num_tokens


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepResult:
    """Per request: tokens to append (empty while a prefill chunk is in flight), how many
    draft tokens were accepted, new draft proposals, and logprobs of appended tokens; and the
    step's wall time, which the speculation controller learns its cost model from."""

    sampled: dict[str, list[int]]
    num_accepted: dict[str, int] = field(default_factory=dict)
    # tree windows: the accepted nodes (1-based window rows, root excluded), in depth order
    accepted_paths: dict[str, list[int]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # drafts laid out as their own block's tree (Proposer.windows; engine.spec.tree.DraftWindow)
    draft_windows: dict[str, DraftWindow] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    elapsed: float = 0.0  # wall seconds the runner spent on the step (models and sampling)
    draft_elapsed: float = 0.0  # the part of ``elapsed`` spent drafting (Proposer.draft_seconds)
