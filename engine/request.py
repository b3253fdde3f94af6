"""Per-request state held by the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams
from engine.spec.acceptance import DecayedRates
from engine.spec.tree import DraftWindow


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # positions whose target K/V is valid
    block_table: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    # their tree and confidence when laid out per block (engine.spec.tree_order; None: the
    # tree's fixed order, or a chain)
    spec_window: DraftWindow | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    spec_rates: DecayedRates | None = None  # its draft acceptance (engine.spec.acceptance)
    generator: torch.Generator | None = None
    # timestamps for metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def sampling_generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator (seeded requests only), created on ``device``, the
        device its logits are sampled on, at first use; None for unseeded requests."""
        if self.params.seed is None:
            return None
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        return self.generator

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        all_tokens = self.prompt_token_ids + self.output_token_ids
        return all_tokens[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1
