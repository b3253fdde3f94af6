"""Per-request drafting gate: stop drafting for a request whose drafts do not pay.

A speculative step costs more than a plain decode step (the target verifies K+1 tokens and the
draft runs), so it pays only while a request's acceptance length stays above that cost ratio.
The gate keeps an exponential moving average of each request's acceptance length; when it
falls below ``min_acceptance_length`` the request decodes without drafts for a pause that
doubles after every failed probe (``first_pause`` steps up to ``max_pause``), then drafts once
more to probe. Whether a step drafts never changes the output: verification is exact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GateState:
    """One request's gate: its smoothed acceptance length and how long it is paused."""

    mean_acceptance: float | None = None
    pause: int = 0  # steps left without drafts
    backoff: int = 0  # the last pause length (0 after a good probe)


class AcceptanceGate:
    def __init__(self, min_acceptance_length: float, smoothing: float = 0.5,
                 first_pause: int = 4, max_pause: int = 64) -> None:
        if min_acceptance_length <= 1.0:
            raise ValueError(f"min_acceptance_length must be > 1, got {min_acceptance_length}")
        self.min_acceptance_length = min_acceptance_length
        self.smoothing = smoothing
        self.first_pause = first_pause
        self.max_pause = max_pause

    def observe(self, state: GateState, num_accepted: int) -> None:
        """Record one verified draft that had ``num_accepted`` tokens accepted."""
        length = 1.0 + num_accepted
        if state.mean_acceptance is None:
            state.mean_acceptance = length
        else:
            a = self.smoothing
            state.mean_acceptance = a * length + (1 - a) * state.mean_acceptance
        if state.mean_acceptance < self.min_acceptance_length:
            state.backoff = min(self.max_pause, 2 * state.backoff if state.backoff else self.first_pause)
            state.pause = state.backoff
        else:
            state.backoff = state.pause = 0

    @staticmethod
    def allows(state: GateState) -> bool:
        """Whether the request may draft this step (a paused request counts down instead)."""
        if state.pause > 0:
            state.pause -= 1
            return False
        return True
