"""What speculation really delivered, against what the controller predicted.

The controller decides from two models (step costs, acceptance) that are each accurate to a
few percent, and it speculates exactly where they promise a gain: its errors therefore lean
one way (a request that looked lucky is chosen, a cost that was under-estimated is chosen).
This tracker closes the loop on the quantity the controller maximises. For every step it
keeps decayed sums of expected and produced tokens, predicted and measured seconds, split by
whether the step speculated (verified or drafted) and by batch size (the rows ladder of the
cost model). The efficiency of a kind of step is ``(produced / expected) * (predicted /
measured)``: 1 when the models are right. The correction for a batch size is the efficiency
of speculative steps relative to plain ones, at most 1: the controller multiplies the gain it
expects from speculating by it, so speculation that promised 10% and delivered 5% less than
plain decoding stops until the models (probes keep refreshing both) promise more.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Sums:
    expected: float = 0.0  # tokens the models promised
    produced: float = 0.0  # tokens the steps produced
    predicted: float = 0.0  # seconds the cost model promised
    measured: float = 0.0  # seconds the steps took
    weight: float = 0.0  # decayed number of steps

    def add(self, decay: float, expected: float, produced: float, predicted: float,
            measured: float) -> None:
        self.expected = decay * self.expected + expected
        self.produced = decay * self.produced + produced
        self.predicted = decay * self.predicted + predicted
        self.measured = decay * self.measured + measured
        self.weight = decay * self.weight + 1.0

    def efficiency(self, min_weight: float) -> float | None:
        if self.weight < min_weight or self.expected <= 0 or self.measured <= 0:
            return None
        return (self.produced / self.expected) * (self.predicted / self.measured)


class RealizedGain:
    """Per batch-size bucket: speculative against plain steps, realized over predicted."""

    def __init__(self, buckets: int, *, decay: float = 0.97, min_weight: float = 4.0,
                 floor: float = 0.5) -> None:
        self.decay = decay
        self.min_weight = min_weight  # decayed steps of a kind before it is trusted
        self.floor = floor
        self._plain = [_Sums() for _ in range(buckets)]
        self._spec = [_Sums() for _ in range(buckets)]

    def observe(self, bucket: int, speculative: bool, expected: float, produced: float,
                predicted: float, measured: float) -> None:
        if expected <= 0 or predicted <= 0 or measured <= 0:
            return
        sums = (self._spec if speculative else self._plain)[bucket]
        sums.add(self.decay, expected, produced, predicted, measured)

    def correction(self, bucket: int) -> float:
        """Factor in ``[floor, 1]`` on the gain the models expect from speculating."""
        spec = self._spec[bucket].efficiency(self.min_weight)
        if spec is None:
            return 1.0
        plain = self._plain[bucket].efficiency(self.min_weight) or 1.0
        return min(1.0, max(self.floor, spec / plain))
