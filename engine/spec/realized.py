"""What speculation really delivered, against what the controller predicted.

The controller decides from two models (step costs, acceptance) that are each accurate to a
few percent, and it speculates exactly where they promise a gain: its errors therefore lean
one way (a request that looked lucky is chosen, a cost that was under-estimated is chosen).
This tracker closes the loop on the quantity the controller maximises. For every step it
keeps decayed sums of expected and produced tokens, predicted and measured seconds, split by
whether the step verified drafts (a step that verifies none is plain, its draft pass for the
next step left out of both its price and its time) and by batch size (the rows ladder of the
cost model). Where every step verifies, the plain side is filled by the controller's plain
probes, asked for as soon as speculative steps are evidence enough and plain ones are not.
The efficiency of a kind of step is ``(produced / expected) * (predicted / measured)``: 1 when
the models are right. The correction for a batch size is the efficiency
of speculative steps relative to plain ones, at most 1: the controller multiplies the gain it
expects from speculating by it, so speculation that promised 10% and delivered 5% less than
plain decoding stops until the models (probes keep refreshing both) promise more.

The speculative efficiency is read at the top of its error bar (``confidence`` standard
errors, from the spread of the steps' own efficiencies), and its evidence ages on the
bucket's plain steps too: a discount drawn from a handful of unlucky or cold steps does not
stop speculation on its own, and one that did stop it does not stand for good. (One stream on
an AVX2 EPYC: its first six drafting steps, with first-call costs and five of eight drafts
rejected, read 0.76, and nothing drafted again for the 1,400 steps that followed, though
drafting there paid about 10%.) Steady evidence narrows the bar: twenty steps that each
deliver a third of their promise stop speculation as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Sums:
    expected: float = 0.0  # tokens the models promised
    produced: float = 0.0  # tokens the steps produced
    predicted: float = 0.0  # seconds the cost model promised
    measured: float = 0.0  # seconds the steps took
    weight: float = 0.0  # decayed number of steps
    squares: float = 0.0  # decayed sum of the squared efficiencies of single steps
    linear: float = 0.0  # decayed sum of the efficiencies of single steps

    def add(self, decay: float, expected: float, produced: float, predicted: float,
            measured: float) -> None:
        self.scale(decay)
        self.expected += expected
        self.produced += produced
        self.predicted += predicted
        self.measured += measured
        self.weight += 1.0
        one = (produced / expected) * (predicted / measured)
        self.linear += one
        self.squares += one * one

    def scale(self, factor: float) -> None:
        """Age every sum alike: the same efficiency, held as fewer steps' evidence."""
        self.expected *= factor
        self.produced *= factor
        self.predicted *= factor
        self.measured *= factor
        self.weight *= factor
        self.squares *= factor
        self.linear *= factor

    def efficiency(self, min_weight: float) -> float | None:
        if self.weight < min_weight or self.expected <= 0 or self.measured <= 0:
            return None
        return (self.produced / self.expected) * (self.predicted / self.measured)

    def standard_error(self, min_spread: float) -> float:
        """Of the efficiency, from the single steps' spread (at least ``min_spread``)."""
        mean = self.linear / self.weight
        spread = math.sqrt(max(0.0, self.squares / self.weight - mean * mean, min_spread**2))
        return spread / math.sqrt(self.weight)


class RealizedGain:
    """Per batch-size bucket: speculative against plain steps, realized over predicted."""

    def __init__(self, buckets: int, *, decay: float = 0.97, min_weight: float = 4.0,
                 floor: float = 0.5, confidence: float = 1.0, min_spread: float = 0.1,
                 idle_decay: float = 0.995) -> None:
        self.decay = decay
        self.min_weight = min_weight  # decayed steps of a kind before it is trusted
        self.floor = floor
        self.confidence = confidence  # standard errors the speculative reading is raised by
        self.min_spread = min_spread  # the least spread of single steps' efficiencies assumed
        self.idle_decay = idle_decay  # ageing of speculative evidence per plain step
        self._plain = [_Sums() for _ in range(buckets)]
        self._spec = [_Sums() for _ in range(buckets)]

    def observe(self, bucket: int, speculative: bool, expected: float, produced: float,
                predicted: float, measured: float) -> None:
        if expected <= 0 or predicted <= 0 or measured <= 0:
            return
        sums = (self._spec if speculative else self._plain)[bucket]
        sums.add(self.decay, expected, produced, predicted, measured)
        if not speculative:
            self._spec[bucket].scale(self.idle_decay)

    def wants_plain(self, bucket: int) -> bool:
        """Whether speculative steps of this bucket have been seen enough to judge, but plain
        ones too few to judge them against (the correction then reads plain steps as
        delivering what the models promised: no check at all)."""
        return (self._spec[bucket].weight >= self.min_weight
                and self._plain[bucket].weight < self.min_weight)

    def correction(self, bucket: int) -> float:
        """Factor in ``[floor, 1]`` on the gain the models expect from speculating."""
        sums = self._spec[bucket]
        spec = sums.efficiency(self.min_weight)
        if spec is None:
            return 1.0
        spec += self.confidence * sums.standard_error(self.min_spread)
        plain = self._plain[bucket].efficiency(self.min_weight) or 1.0
        return min(1.0, max(self.floor, spec / plain))
