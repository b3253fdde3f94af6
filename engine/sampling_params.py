"""Sampling parameters, validated at construction with typed errors."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

_MIN_TEMPERATURE = 1e-5


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def split(self) -> list[SamplingParams]:
        """One set of params per sample (``n`` of them, each with ``n=1``); a seeded request's
        sample ``i`` uses ``seed + i``, so samples differ yet stay reproducible."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k in (-1, None):
            self.top_k = 0
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value),
                   f"{name} must be a finite number, got {value!r}", name)
        if 0 < self.temperature < _MIN_TEMPERATURE:
            self.temperature = 0.0  # below this, softmax(logits / T) is argmax up to rounding
        _check(self.n >= 1, f"n must be at least 1, got {self.n}", "n")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}",
                   "max_tokens")
        _check(self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}",
               "temperature")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(self.top_k >= 0, f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}",
               "top_k")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(-2 <= self.presence_penalty <= 2,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
               "frequency_penalty")
        _check(self.repetition_penalty > 0,
               f"repetition_penalty must be greater than zero, got {self.repetition_penalty}",
               "repetition_penalty")
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}",
               "min_tokens")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                   "min_tokens")
        if self.logprobs is not None:
            _check(self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}",
                   "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise SamplingParamsError(message, param)
