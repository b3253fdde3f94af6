"""The speculation controller: per step, how many drafts each request verifies.

Called by the scheduler once per step with the requests that sample this step. For request
``i`` verifying ``k_i`` drafts, the expected tokens it gains are ``1 + g_i1 + ... + g_ik``
(``g_ij`` = chance draft ``j`` is accepted, from the acceptance model), and the step costs
``step_time(rows, base + sum k_i) + draft_time(#drafting, their draft slots)`` (from the
measured cost model).
The controller maximises expected tokens per second of the whole batch: for a fixed number of
extra query tokens ``M`` the best choice is the ``M`` largest gains (each request's gains do
not increase with ``j``, so they are taken in order), so it evaluates every ``M`` and keeps
the best. ``k = 0`` is a plain decode. Whether a request drafts for the next step is decided
with the draft pass counted (the steady-state rate); how many of the drafts it holds now are
verified is decided without it, since that pass is already paid for.

A request that stops drafting stops producing evidence, so the controller probes: every
``probe_interval`` steps (doubling while probes keep finding that nobody's drafts pay, up to
``max_probe_interval``) one request, in turn, drafts once, and the next step verifies all of
its drafts, which refreshes both the acceptance (every position) and the verification cost
estimates (up to the largest block); every other probe verifies a single draft, which
re-measures the smallest block.
(Probing every request at once cost a draft pass and a verification for the whole batch,
about 3% of the throughput at 32 requests where speculation never paid.)
The converse: where every step verifies, no plain step measures what a step without drafts
costs, so now and then one step verifies nothing (a plain probe, see ``plain_probe_interval``).
The models' errors lean towards speculating (it is chosen exactly where they promise most),
so every step's realized tokens per second are compared with the prediction
(``engine.spec.realized``): where speculative steps deliver less than promised relative to
plain ones, the promised gain is discounted by that factor for that batch size.
With ``adaptive=False`` every request drafts and verifies all it can (fixed K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.spec.acceptance import AcceptanceModel, ConfidenceScale, DecayedRates
from engine.spec.cost import StepCostModel
from engine.spec.realized import RealizedGain
from engine.spec.stats import SpecDecodingStats
from engine.spec.tree import DraftTree, slots_needed


@dataclass
class Candidate:
    """A request that samples this step."""

    state: DecayedRates | None  # its acceptance counts (None: fresh request)
    available: int  # drafts it holds for this step
    cap: int  # at most this many may be verified (budget, context, max_tokens)
    tokens: int  # query tokens it runs without drafts (1 for decode, a chunk for prefill)
    # the drafts' own block's chance that each is accepted (engine.spec.tree_order), if known
    confidence: list[float] | None = None


@dataclass
class Decision:
    k: int  # drafts to verify this step
    draft: int  # drafts to propose for the next step (0: none; the proposer makes only these)


class SpecController:
    def __init__(self, k_max: int, acceptance: AcceptanceModel, cost: StepCostModel | None,
                 stats: SpecDecodingStats, *, adaptive: bool = True,
                 max_batch: int | None = None, min_gain: float = 1.03, probe_interval: int = 8,
                 max_probe_interval: int = 256, replan_interval: int = 4,
                 max_replan_interval: int = 32,
                 plain_probe_interval: int = 32, max_plain_probe_interval: int = 512,
                 tree: DraftTree | None = None) -> None:
        if adaptive and cost is None:
            raise ValueError("the adaptive controller needs a step cost model")
        self.k_max = k_max
        # drafts are the nodes of this tree, in its order (None: a chain); verifying k drafts
        # means its first k nodes, which the scheduler lays out from it
        self.tree = tree
        # slots[n]: the draft block slots the first n drafts occupy (a proposer runs those
        # alone, and the cost model prices a drafting request by them)
        self.slots = slots_needed(tree, k_max)
        self._slot_steps = np.diff(np.asarray(self.slots, float))  # per draft, in order
        self.acceptance = acceptance
        # how the blocks' own confidence in their drafts compares with verification (drafts
        # laid out per block, engine.spec.tree_order)
        self.confidence = ConfidenceScale()
        self.cost = cost
        self.realized = RealizedGain(len(cost.rows)) if cost is not None else None
        self.stats = stats
        self.adaptive = adaptive
        self.max_batch = max_batch  # no drafts while more requests than this sample
        # drafting must promise at least this factor over a plain step. 1.03 by default: at
        # 16 and 32 requests (HTTP, held-out chat) the models promised +0.1% and +1.3% for
        # drafting every request with the fresh-request prior, within their errors (plain
        # 16-request steps priced 26.8 ms took 28.9; promised tokens came 3-15% short), and
        # taking them served 0.83-0.96x no speculation while the realized-gain check saw
        # speculative steps priced too high and plain ones too low. An earlier margin of 1.05
        # kept one stream at 1.07-1.11x no speculation where verifying 3 drafts every step
        # gave 1.20x (a weaker draft's recorded acceptance, benchmarks/replay_policy.py);
        # the promise at one stream is now about 1.5x and at 8 requests about 1.1x
        self.min_gain = min_gain
        self.first_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_interval = probe_interval
        self._steps_to_probe = probe_interval
        self._verify_probe = False  # the step after a probe verifies at least one draft
        self._probes_verified = 0  # whole blocks and single drafts alternate (see plan)
        self._probe_turn = 0  # which request the next probe makes draft
        # the step last planned makes or verifies a probe's drafts: exploration, which the
        # realized-gain check leaves out (see observe_step)
        self._exploring = False
        # the step last planned verifies a probe's drafts: a deliberate measurement of the
        # largest blocks, which refines the cost model with plain_probe_weight (a block
        # measured cheaper also bounds the smaller blocks' prices, StepCostModel.observe)
        self._probe_verifying = False
        # A plan that drafts nobody, with no drafts held, stands for ``replan_interval`` steps
        # while the batch size (its bucket of the cost model's rows) and the acceptance
        # evidence (no verification since) are unchanged, and twice as long each time a
        # replan finds it again, up to ``max_replan_interval``: what still moves then
        # (requests' own evidence ageing towards the engine-wide curve, the step costs
        # refined by a step, a request more or less) moves slowly, and pricing every extra
        # token of a 16-request batch cost 0.2-0.4 ms (cold caches after the forward pass),
        # about 1% of a step where speculation does not pay. Standing only while the exact
        # rows and tokens held, the plan was priced again in 237 of 495 steps of a closed loop
        # of 16 (AVX-512-BF16 EPYC): requests joining and leaving change them every few steps
        self.replan_interval = replan_interval
        self.max_replan_interval = max(replan_interval, max_replan_interval)
        self._standing: tuple[int, int] | None = None  # (rows bucket, acceptance version)
        self._standing_steps = 0
        self._standing_length = replan_interval
        # Plain probes. A plain step measures the level of its batch size's cost line (see
        # StepCostModel.observe); where every step verifies, nothing does, and a level raised
        # by a slow spell of the machine stays raised: at 16 requests a line read 38.9 ms for
        # a plain step that took 24.8 while verifying steps drifted to their own cells, so
        # every request drafted and verified at every step for 200 steps, 0.628 tokens/ms
        # against 0.660 without drafts (12% below no speculation over the round). So when a
        # batch size has verified at every step for ``plain_probe_interval`` steps, one step
        # verifies nothing (the drafts held are dropped; drafting goes on as planned) and
        # its time refines the line with ``plain_probe_weight`` times the usual weight; the
        # interval doubles (to ``max_plain_probe_interval``) while probes find the level
        # within 10% of its price, and starts over when one does not
        buckets = len(cost.rows) if cost is not None else 1
        self.plain_probe_interval = plain_probe_interval
        self.max_plain_probe_interval = max_plain_probe_interval
        self.plain_probe_weight = 5.0
        self._plain_every = [plain_probe_interval] * buckets
        self._verifying_run = [0] * buckets  # whole-decode steps since one verified nothing
        self._plain_probe = False  # the step last planned is a plain probe
        self.on_refined: Callable[[StepCostModel], None] | None = None  # persist the costs
        self.refine_save_every = 1000  # steps
        self._steps_since_save = 0

    # -- decisions ---------------------------------------------------------------------------
    def plan(self, cands: list[Candidate], other_tokens: int = 0) -> list[Decision]:
        """One decision per candidate. ``other_tokens``: query tokens of scheduled requests
        that do not sample this step (prefill chunks)."""
        if not cands:
            return []
        if self.max_batch is not None and len(cands) > self.max_batch:
            return [Decision(0, 0) for _ in cands]
        if not self.adaptive:
            return [Decision(min(self.k_max, c.available, c.cap), self.k_max) for c in cands]
        # Drafts for the next step are made where they pay with the draft pass counted; the
        # drafts held now were paid for last step, so verification leaves that cost out.
        verify = any(c.available for c in cands)
        if not verify and self._stands(len(cands)):
            # a plan that drafts nobody stands while its inputs do (see replan_interval)
            self._standing_steps -= 1
            draft_ks = verify_ks = [0] * len(cands)
        else:
            draft_ks, verify_ks = self._optimal_ks(cands, other_tokens, verify=verify)
            if not verify and not any(draft_ks):
                key = self._standing_key(len(cands))
                again = key == self._standing
                self._standing_length = (min(self.max_replan_interval, 2 * self._standing_length)
                                         if again else self.replan_interval)
                self._standing = key
                self._standing_steps = self._standing_length - 1
            else:
                self._standing = None
        self._exploring = self._verify_probe
        self._probe_verifying = self._verify_probe
        if self._verify_probe:
            # a probe's drafts are verified whole: the deep positions' acceptance and the
            # price of the largest block are measured too (where nothing else drafts, they
            # are the only evidence, and a startup calibration that over-priced the block
            # was never corrected while probes verified one draft). Every other probe
            # verifies a single draft instead: whole blocks bound only the smaller blocks
            # priced above them, and one stream whose calibration priced 2 and 4 tokens
            # 22-32% above a plain step (standalone: 10-16%; an AVX2 EPYC, bf16) never
            # drafted (0.98x no speculation) while its large blocks were priced right
            whole = self._probes_verified % 2 == 0
            self._probes_verified += 1
            verify_ks = [v or (c.available if whole else min(1, c.available))
                         for v, c in zip(verify_ks, cands)]
        elif any(verify_ks):
            b = self.cost.row_bucket(len(cands))
            assert self.realized is not None
            if self._verifying_run[b] >= self._plain_every[b] or self.realized.wants_plain(b):
                # a plain probe (see plain_probe_interval), also while the realized-gain check
                # has too few plain steps of this batch size to compare verifying ones with
                verify_ks = [0] * len(cands)
                self._plain_probe = True
        probe = self._probe_due(any(k > 0 for k in draft_ks))
        self._verify_probe = probe
        self._exploring |= probe
        probed = -1
        if probe:
            probed = self._probe_turn % len(cands)
            self._probe_turn += 1
        # a probe's request drafts the whole block (its next step may verify all of it)
        return [Decision(min(v, c.available, c.cap), self.k_max if i == probed else d)
                for i, (c, v, d) in enumerate(zip(cands, verify_ks, draft_ks))]

    def _probe_due(self, some_draft: bool) -> bool:
        self._steps_to_probe -= 1
        if self._steps_to_probe > 0:
            return False
        # a probe while nobody drafts that still finds nothing worth drafting makes the next
        # probe wait longer; as soon as drafting pays anywhere, probing is frequent again
        if some_draft:
            self.probe_interval = self.first_probe_interval
        else:
            self.probe_interval = min(self.max_probe_interval, 2 * self.probe_interval)
        self._steps_to_probe = self.probe_interval
        return True

    def _standing_key(self, rows: int) -> tuple[int, int]:
        assert self.cost is not None
        return self.cost.row_bucket(rows), self.acceptance.version

    def _stands(self, rows: int) -> bool:
        """A plan that drafts nobody stands for a batch of ``rows`` now."""
        return self._standing_steps > 0 and self._standing == self._standing_key(rows)

    def fresh_request_drafts(self, batch_rows: int) -> int:
        """The drafts a request entering a batch of ``batch_rows`` would make (prior curve;
        0: it does not draft, as where a plan that drafts nobody stands for that batch size)."""
        if self.max_batch is not None and batch_rows > self.max_batch:
            return 0
        if not self.adaptive:
            return self.k_max
        if self._stands(max(1, batch_rows)):
            return 0
        c = Candidate(None, self.k_max, self.k_max, 1)
        return self._optimal_ks([c] * max(1, batch_rows), 0, verify=False)[0][0]

    def _optimal_ks(self, cands: list[Candidate], other_tokens: int, *, verify: bool
                    ) -> tuple[list[int], list[int]]:
        """Per candidate: the drafts worth making for the next step (the draft pass counted)
        and, with ``verify``, worth verifying now (the pass already paid; else zeros). Each
        comes from a ranking of the extra tokens, priced from one reading of the step's cost
        line: the drafts to make, from the acceptance model's gains; the drafts held, from
        their own block's confidence in them where candidates have it (one ranking serves both
        where none has)."""
        cost = self.cost
        assert cost is not None
        rows = len(cands)
        none = [0] * rows
        # every possible extra token: its gain (row-major: a request's gains in order) and owner
        table = np.asarray([self.acceptance.gains(c.state) for c in cands])  # [rows, K]
        limit = np.minimum(self.k_max, np.fromiter((c.cap for c in cands), int, rows))
        base = other_tokens + sum(c.tokens for c in cands)
        assert self.realized is not None
        discount = self.realized.correction(cost.row_bucket(rows))

        def best_ks(rates: np.ndarray, who: np.ndarray) -> list[int]:
            best = int(np.argmax(rates))  # the first best: fewer drafts on a tie
            if discount * rates[best] < self.min_gain * rates[0]:
                return none  # within the cost model's error of a plain step: do not speculate
            return np.bincount(who[:best], minlength=rows).tolist()

        usable = (np.arange(table.shape[1]) < limit[:, None]) & (table >= 1e-3)
        ranked = _rank(table, usable)
        # the drafts held now: their own block's confidence in each, where the proposer gives
        # it (engine.spec.tree_order), else the acceptance model's gains
        held = None
        if verify and any(c.confidence is not None for c in cands):
            confident = np.zeros_like(table)
            for i, c in enumerate(cands):
                own = (self.confidence.gains(c.confidence) if c.confidence is not None
                       else table[i])
                n = min(len(own), confident.shape[1])
                confident[i, :n] = own[:n]
            held = _rank(confident, (np.arange(confident.shape[1]) < limit[:, None])
                         & (confident >= 1e-3))
        elif verify:
            held = ranked
        # one reading of the step's cost line serves both rankings (cold caches: 183 us a
        # reading at one stream, docs/performance.md "Twenty-eighth pass")
        longest = max((len(r[0]) for r in (ranked, held) if r is not None), default=0)
        line = cost.step_times(rows, base + np.arange(longest + 1))
        drafting = none
        if ranked is not None:
            order, who, expected = ranked
            # the extra token that makes a request draft at all: its first gain, which (gains
            # usable in a prefix of each row, the sort stable) comes first among its own
            counts = usable.sum(axis=1)
            starts = (np.cumsum(counts) - counts)[counts > 0]  # flat index of each first gain
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            first = np.zeros(len(order) + 1)
            first[rank[starts] + 1] = 1.0
            # the draft slots the leading extra tokens occupy in all (a request's drafts in
            # order)
            steps = np.broadcast_to(self._slot_steps[:table.shape[1]], table.shape)[usable]
            slots = np.concatenate(([0.0], np.cumsum(steps[order])))
            drafting = best_ks((rows + expected) / (
                line[:len(order) + 1] + cost.draft_times(np.cumsum(first), slots)), who)
        if held is None:
            return drafting, none
        _, who, expected = held
        return drafting, best_ks((rows + expected) / line[:len(expected)], who)

    # -- feedback ------------------------------------------------------------------------------
    def observe(self, state: DecayedRates, num_verified: int, num_accepted: int,
                path: list[int] | None = None, confidence: list[float] | None = None) -> None:
        """One sampling request's step: ``num_verified`` drafts (0: a plain decode);
        ``path``: the accepted nodes of a tree window; ``confidence``: the drafts' own
        block's chance of each (``Candidate.confidence``)."""
        self.stats.observe_choice(num_verified)
        self.acceptance.observe(state, num_verified, num_accepted, path)  # a plain step ages it
        if confidence is not None and num_verified > 0:
            self.confidence.observe(confidence[:num_verified], num_accepted)
        if num_verified > 0:
            self.stats.observe(num_verified, num_accepted)

    def expected_tokens(self, state: DecayedRates | None, num_verified: int,
                        confidence: list[float] | None = None) -> float:
        """Tokens a sampling request is expected to produce verifying ``num_verified`` drafts
        (call before :meth:`observe` folds the outcome in), from its drafts' ``confidence``
        where the proposer gave it (what the choice was made from)."""
        if num_verified <= 0:
            return 1.0  # a plain decode (most rows of most steps): no curve to evaluate
        if confidence is not None:
            return 1.0 + sum(self.confidence.gains(confidence[:num_verified]))
        return 1.0 + sum(self.acceptance.gains(state)[:num_verified])

    def draft_slots(self, num_drafts: int) -> int:
        """The draft block slots a request making ``num_drafts`` drafts occupies."""
        return self.slots[max(0, min(num_drafts, self.k_max))]

    def observe_step(self, rows: int, tokens: int, drafted_rows: int, seconds: float, *,
                     verified: int = 0, expected: float | None = None,
                     produced: int | None = None, draft_seconds: float = 0.0,
                     drafted_slots: int = 0) -> None:
        """One real step's wall time refines the cost model (saved now and then).

        ``expected``/``produced``: tokens the sampling rows were expected to produce (from
        :meth:`expected_tokens`) and did produce, given only for steps in which every row
        samples; they feed the realized-gain check. ``draft_seconds``: the part of
        ``seconds`` the proposer took, drafting ``drafted_slots`` slots in all (see
        :meth:`StepCostModel.observe`)."""
        if self.cost is None:
            return
        exploring, self._exploring = self._exploring, False
        probe_verifying, self._probe_verifying = self._probe_verifying, False
        plain_probe, self._plain_probe = self._plain_probe, False
        step_price = self.cost.step_time(rows, tokens)
        predicted = step_price + self.cost.draft_time(drafted_rows, drafted_slots)
        weight = self.plain_probe_weight if probe_verifying and verified else 1.0
        if expected is not None:  # every row decodes: a step the controller chose
            b = self.cost.row_bucket(rows)
            if verified:
                self._verifying_run[b] += 1
            else:
                self._verifying_run[b] = 0
            if plain_probe and not verified:
                weight = self.plain_probe_weight
                off = abs(seconds / predicted - 1.0) > 0.1
                self._plain_every[b] = (self.plain_probe_interval if off else min(
                    self.max_plain_probe_interval, 2 * self._plain_every[b]))
        # Probes are left out of the realized-gain check: they are chosen by turn, not by the
        # models, and a batch verifying one request's drafts is priced right, so where
        # drafting had been found to deliver less than promised their steps (at 16 requests
        # one probe every 8 steps) pulled the discount back to 1 and drafting resumed for
        # dozens of steps, each 4% below a plain step, until it was found again
        # A step that verifies nothing is plain evidence, drafting or not: its draft pass (for
        # the next step, priced and timed apart) is left out of both sides. Counted as
        # speculative instead, the plain probes of a batch verifying at every step (they draft
        # as planned) never reached the plain side, whose efficiency then read as the model's
        # own (1): 16 streams on a table that priced 16 rows as 16 one-row steps (up to 32
        # more tokens at nothing over a plain step) verified at every step for 300 steps at
        # 0.56x no speculation while the check read 1.00
        if expected is not None and produced is not None and not exploring:
            assert self.realized is not None  # (b: the bucket read above)
            if verified:
                self.realized.observe(b, True, expected, produced, predicted, seconds)
            elif seconds > draft_seconds:
                self.realized.observe(b, False, expected, produced, step_price,
                                      seconds - draft_seconds)
        self.cost.observe(rows, tokens, drafted_rows, seconds, draft_seconds, weight,
                          drafted_slots)
        self._steps_since_save += 1
        if self.on_refined is not None and self._steps_since_save >= self.refine_save_every:
            self._steps_since_save = 0
            self.on_refined(self.cost)


def _rank(table: np.ndarray, usable: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The ``usable`` gains of ``table`` (``[rows, K]``) largest first, a request's own kept in
    order: their order (flat indices into ``table[usable]``), their owners, and the extra
    tokens the leading ``n`` are expected to add (``n = 0, 1, ...``); ``None``: none usable."""
    gains = table[usable]
    if not gains.size:
        return None
    order = np.argsort(-gains, kind="stable")
    return order, np.nonzero(usable)[0][order], np.concatenate(([0.0], np.cumsum(gains[order])))

