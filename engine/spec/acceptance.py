"""Acceptance model: how many draft tokens a request is expected to get accepted.

A verification of ``k`` drafts with ``n`` accepted observes positions ``1..min(n+1, k)``:
positions ``1..n`` were accepted given their predecessors were, position ``n+1`` (when
``n < k``) was rejected, and later positions were not observed. Each position ``j`` therefore
has a conditional acceptance rate ``a_j = P(accept j | accepted 1..j-1)``, estimated from
exponentially decayed counts.

Two levels share one update rule: an engine-wide curve (the draft's behaviour on the live
traffic, seeded from the curve measured when the draft was evaluated and stored beside it) and
one curve per request, whose prior is the engine-wide curve. A new request therefore starts
from what the draft does on the current traffic and moves to its own rate within a few steps.

A request's own evidence ages with its steps, verifying or not: acceptance comes in runs (an
equation is drafted well, the prose around it less so), so what the last few drafts did says
less and less about the next one as the text moves on. Without aging, a request whose drafts
were rejected twice stopped drafting and kept its pessimistic curve through every plain step
that followed: on GSM8K, one stream spent 145 of 288 request steps without drafting and ran at
1.41x no speculation where always verifying 3 drafts ran at 1.70x.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("specserve.spec")

ACCEPTANCE_FILE = "acceptance.json"  # beside a draft: {"conditional": [a_1, ..., a_K], ...}
DEFAULT_PRIOR = 0.5  # per position, when the draft ships no measured curve


@dataclass
class DecayedRates:
    """Per-position conditional acceptance from decayed (hits, trials) counts plus a prior.

    Ageing is one multiplication: the counts are kept unscaled beside a common ``scale``
    (folded in when a verification is observed), since most requests of a loaded batch age
    every step and verify rarely."""

    raw_hits: list[float]
    raw_trials: list[float]
    decay: float
    scale: float = 1.0
    # (model version, expected gains) from AcceptanceModel.gains
    cached: tuple[int, list[float]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, k: int, decay: float) -> DecayedRates:
        return cls([0.0] * k, [0.0] * k, decay)

    @property
    def hits(self) -> list[float]:
        return [self.scale * h for h in self.raw_hits]

    @property
    def trials(self) -> list[float]:
        return [self.scale * t for t in self.raw_trials]

    def age(self) -> None:
        """A step without verification: the evidence decays as if one had been observed."""
        if self.scale * self.raw_trials[0] < 1e-3:  # the most observed position: nothing to age
            return
        self.scale *= self.decay
        self.cached = None

    def observe(self, parents: tuple[int, ...], num_verified: int, path: list[int]) -> None:
        """One window of the first ``num_verified`` drafts: draft ``j`` was tried when its
        parent was accepted (the root always is) and hit when it is on the accepted ``path``
        (1-based). For a chain (``parents[j - 1] == j - 1``) with ``n`` accepted: positions
        ``1..n`` hit, ``n + 1`` missed, later ones not observed."""
        if self.scale != 1.0:
            self.raw_hits, self.raw_trials, self.scale = self.hits, self.trials, 1.0
        hits, trials, d = self.raw_hits, self.raw_trials, self.decay
        on_path = {0, *path}
        for j in range(num_verified):
            if parents[j] in on_path:
                hits[j] = d * hits[j] + (1.0 if j + 1 in on_path else 0.0)
                trials[j] = d * trials[j] + 1.0

    def rates(self, prior: list[float], prior_weight: float) -> list[float]:
        s = self.scale
        return [(s * h + prior_weight * p) / (s * t + prior_weight)
                for h, t, p in zip(self.raw_hits, self.raw_trials, prior)]


class AcceptanceModel:
    """Engine-wide and per-request conditional acceptance curves for ``K`` positions, or for
    the ``K`` nodes of a tree of drafts (``parents``, see ``engine.spec.tree``): node ``j``'s
    rate is then its chance of acceptance when its parent is accepted."""

    def __init__(self, k: int, seed_curve: list[float] | None = None, *,
                 parents: tuple[int, ...] | None = None,
                 seed_weight: float = 16.0, global_decay: float = 0.98,
                 request_weight: float = 4.0, request_decay: float = 0.85) -> None:
        if parents is not None and len(parents) != k:
            raise ValueError(f"{len(parents)} parents for {k} nodes")
        self.k = k
        self.parents = tuple(range(k)) if parents is None else parents  # a chain by default
        curve = list(seed_curve or [])[:k]
        curve += [curve[-1] if curve else DEFAULT_PRIOR] * (k - len(curve))
        self.seed = [min(max(a, 0.0), 1.0) for a in curve]
        self.seed_weight = seed_weight
        self.request_weight = request_weight
        self.request_decay = request_decay
        self.global_counts = DecayedRates.empty(k, global_decay)
        self.version = 0  # counts the verifications observed: every curve may have moved
        self._fresh: tuple[int, list[float]] | None = None  # gains of a fresh request
        self._global: tuple[int, list[float]] | None = None  # engine-wide rates, by version

    def new_request(self) -> DecayedRates:
        return DecayedRates.empty(self.k, self.request_decay)

    def global_rates(self) -> list[float]:
        return list(self._global_rates())

    def _global_rates(self) -> list[float]:
        """The engine-wide curve (every request's prior), computed once per version (shared:
        do not modify)."""
        if self._global is None or self._global[0] != self.version:
            self._global = (self.version, self.global_counts.rates(self.seed, self.seed_weight))
        return self._global[1]

    def rates(self, state: DecayedRates | None, prior: list[float] | None = None) -> list[float]:
        """Conditional acceptance per position for a request (``None``: a fresh one)."""
        if state is None:
            return list(self._global_rates()) if prior is None else prior
        return state.rates(self._global_rates() if prior is None else prior,
                           self.request_weight)

    def gains(self, state: DecayedRates | None) -> list[float]:
        """:func:`expected_gains` of a request's curve (``None``: a fresh one), computed once
        per verification observed anywhere: while nothing is verified (a batch too large for
        speculation to pay) no curve moves, and each step's plan reads them again."""
        if state is None:
            if self._fresh is None or self._fresh[0] != self.version:
                self._fresh = (self.version, expected_gains(self._global_rates(), self.parents))
            return self._fresh[1]
        if state.cached is None or state.cached[0] != self.version:
            state.cached = (self.version, expected_gains(self.rates(state), self.parents))
        return state.cached[1]

    def observe(self, state: DecayedRates, num_verified: int, num_accepted: int,
                path: list[int] | None = None) -> None:
        """One window: ``num_verified`` drafts, ``num_accepted`` accepted; for a tree, the
        accepted nodes (``path``, 1-based) say which nodes were tried."""
        if num_verified <= 0:
            state.age()  # the request's own curve only: the engine-wide one saw nothing
            return
        path = list(range(1, num_accepted + 1)) if path is None else path  # a chain window
        state.observe(self.parents, num_verified, path)
        self.global_counts.observe(self.parents, num_verified, path)
        self.version += 1


@dataclass
class ConfidenceScale:
    """How a draft's own confidence in its drafts (``engine.spec.tree_order``) compares with
    what verification accepts: decayed sums of the confidence of every draft verified and of
    the drafts accepted, starting from ``prior`` drafts' worth of a calibrated draft.
    Confidence is a chance computed on the draft's training distribution; served traffic
    may be harder or easier, so the gains it promises are scaled by what it delivers."""

    decay: float = 0.995  # per verified window
    prior: float = 16.0
    predicted: float = 0.0
    accepted: float = 0.0

    @property
    def factor(self) -> float:
        return (self.accepted + self.prior) / (self.predicted + self.prior)

    def gains(self, confidence: list[float]) -> list[float]:
        """Each held draft's chance of acceptance: its confidence, scaled (at most 1)."""
        f = self.factor
        return [min(1.0, f * c) for c in confidence]

    def observe(self, confidence: list[float], num_accepted: int) -> None:
        """A window verified drafts of these confidences and accepted ``num_accepted``."""
        self.predicted = self.decay * self.predicted + sum(confidence)
        self.accepted = self.decay * self.accepted + num_accepted


def expected_gains(rates: list[float], parents: tuple[int, ...] | None = None) -> list[float]:
    """``g_j``, the chance that draft ``j`` is accepted: the product of the rates along its
    path (``a_1 * ... * a_j`` for a chain, the default ``parents``). The gains are then held
    non-increasing in draft order (a no-op for a chain), since the controller verifies leading
    drafts: a later node never makes an earlier one worth more."""
    parents = tuple(range(len(rates))) if parents is None else parents
    raw: list[float] = []
    out: list[float] = []
    for j, a in enumerate(rates):
        raw.append(a * (raw[parents[j] - 1] if parents[j] else 1.0))
        out.append(min(raw[-1], out[-1]) if out else raw[-1])
    return out


def load_seed_curve(draft_dir: str | Path | None) -> list[float] | None:
    """The conditional acceptance curve measured for a draft (``acceptance.json``), if any.

    A missing file means no seed; a malformed one is logged and ignored, never fatal.
    """
    if draft_dir is None:
        return None
    path = Path(draft_dir) / ACCEPTANCE_FILE
    if not path.is_file():
        return None
    try:
        curve = json.loads(path.read_text())["conditional"]
        if not curve or not all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in curve):
            raise ValueError("'conditional' must be a non-empty list of numbers in [0, 1]")
        return [float(a) for a in curve]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
