"""Step cost model, measured on the machine it runs on.

``step_time(rows, tokens)`` is the time of one engine step (target forward, sampling, the
draft's context update) with ``rows`` requests and ``tokens`` query tokens in all;
``draft_time(rows, slots)`` is what a DFlash block pass for ``rows`` requests drafting ``slots``
block slots in all adds (one a request, plus a measured price per further slot). Both come from a
grid measured at startup with the real runner on synthetic requests (rows 1, 4, 16, 64; total
query tokens at powers of two and on both sides of 16, 32, 48 and 64, within a few seconds),
interpolated in between, cached per machine and model, and refined online from the timings of
real steps: a plain step moves the level of its rows' whole line (every block size alike), a
verifying step only the token columns it was priced from, a drafting step the draft curve with
the proposer's drafting time (``Proposer.draft_seconds``: the block pass, not the draft context
it catches up) and the table with the rest. A line is read non-decreasing in tokens.

The token axis counts a step's query tokens in all, not per row, because the products that
dominate a CPU step cost by their rows in all: with AMX, oneDNN runs them in tiles of 16 rows,
and a step of 17 query tokens took 3.3-3.8 ms more than one of 16 at 1, 4 and 8 requests alike
(SmolLM2-135M, bfloat16, 2-vCPU Xeon; then +0.2 ms per token up to 32, +2.1 ms at 33). A
per-row axis with knots at powers of two priced 17-20 tokens on 8 rows by a straight line from
16 to 32, 2.6-3.3 ms under their cost, exactly where an 8-request batch verifying one or two
drafts a row lands. The knots on both sides of each 16 measure that staircase where it exists
and cost a few calibration steps where it does not.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.outputs import ScheduledRequest, StepPlan
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.runner import ModelRunner

log = logging.getLogger("specserve.spec")

CALIBRATION_CONTEXT = 256  # context length of the synthetic requests
# token counts measured on both sides of: where 16-row matrix tiles (AMX) add a tile
TILE_EDGES = (16, 32, 48, 64)


@dataclass
class StepCostModel:
    rows: list[int]  # ladder of batch rows
    tokens: list[int]  # ladder of query tokens in all (a step's rows together)
    table: list[list[float]]  # seconds; table[i][j]: rows[i] rows running tokens[j] tokens
    # (below tokens == rows[i], where a line starts, its plain step's time)
    # seconds a draft pass adds for rows[i] requests drafting one slot each (0 without a draft)
    draft: list[float]
    max_per_row: int  # the largest block a row verifies (larger steps are prefill chunks)
    # seconds each further drafted slot (a request's next draft position) adds, at rows[i]
    # requests: a proposer runs only the slots a request's drafts need (engine.spec.dflash)
    draft_slot: list[float] | None = None
    smoothing: float = 0.1  # online refinement weight of one step

    def __post_init__(self) -> None:
        if self.draft_slot is None:
            self.draft_slot = [0.0] * len(self.rows)

    # -- one step: pure Python, since it runs every step right after the forward pass has
    # evicted the caches, where the dozen small numpy calls of the vectorised reading took
    # 0.15 ms (2-vCPU Xeon, 16 requests: against 0.01 ms warm) --------------------------------
    def step_time(self, rows: int, tokens: int, ordered: bool = True) -> float:
        rows = max(1, rows)
        return self._across_rows(rows, max(float(rows), float(tokens)),
                                 lambda i, t: self._cell(i, t, ordered))

    def draft_time(self, rows: int, slots: int = 0) -> float:
        """A draft pass for ``rows`` requests drafting ``slots`` slots in all (at least one
        each: fewer count as one each)."""
        xs = self.rows
        if rows <= 0:
            return 0.0
        extra = max(0, slots - rows)
        if rows > xs[-1]:
            scale = rows / xs[-1]
            return self.draft[-1] * scale + self.draft_slot[-1] * extra
        return (read_point(xs, self.draft, float(rows), slope=False)
                + read_point(xs, self.draft_slot, float(rows), slope=False) * extra)

    def _cell(self, i: int, t: float, ordered: bool) -> float:
        line = self.table[i]
        return read_point(self.tokens, list(itertools.accumulate(line, max)) if ordered
                          else line, t)

    # -- vectorised: the controller prices every extra token of a step at once -----------------
    def _line(self, i: int, t: np.ndarray, ordered: bool = True) -> np.ndarray:
        # read in order: more tokens never cost less than fewer. Plain steps move the whole
        # line and verifying steps only their columns, so the cells drift apart: on one
        # stream the plain cell once ended at 20.3 ms above the two-token cell's 18.8, drafts
        # priced cheaper than the step that verifies none. Ordering the cells where they are
        # written instead let every upward blip of one column lift the columns beyond it for
        # good (one stream's line ended at 18 / 25 / 29 / 37 ms for 1 / 2 / 4 / 8 tokens
        # after 1,100 steps; whole steps verifying 32 drafts took 36 ms). Refinement
        # compares a step with the cells as written (``ordered`` false): against the ordered
        # price, a cell below it would sink without end
        ys = np.asarray(self.table[i], float)
        if ordered:
            ys = np.maximum.accumulate(ys)
        return read_line(self.tokens, ys, t)

    def step_times(self, rows: int, tokens: np.ndarray, ordered: bool = True) -> np.ndarray:
        """``step_time(rows, t)`` for every ``t`` in ``tokens``."""
        rows = max(1, rows)
        return self._across_rows(rows, np.maximum(float(rows), np.asarray(tokens, float)),
                                 lambda i, t: self._line(i, t, ordered))

    def _across_rows(self, rows: int, t, line):
        """``line(i, t)`` (line ``i`` read at ``t``, scalar or array) for ``rows`` rows:
        between two lines linearly; past the ladder, the last line's tokens per row, scaled."""
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows or i == 0:
            return line(min(i, len(self.rows) - 1), t)
        if i == len(self.rows):
            scale = rows / self.rows[-1]
            return line(i - 1, t / scale) * scale
        r0, r1 = self.rows[i - 1], self.rows[i]
        t0, t1 = line(i - 1, t), line(i, t)
        return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)

    def draft_times(self, rows: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """``draft_time(n, s)`` for every ``n`` in ``rows`` and ``s`` in ``slots``."""
        rows = np.asarray(rows, float)
        xs, ys = np.asarray(self.rows, float), np.asarray(self.draft, float)
        out = np.interp(rows, xs, ys)
        past = rows > xs[-1]
        out[past] = ys[-1] * rows[past] / xs[-1]
        if slots is not None:
            extra = np.maximum(0.0, np.asarray(slots, float) - rows)
            out += np.interp(rows, xs, np.asarray(self.draft_slot, float)) * extra
        out[rows <= 0] = 0.0
        return out

    # -- online refinement ---------------------------------------------------------------------
    def row_bucket(self, rows: int) -> int:
        """Index of the ladder's batch size nearest to ``rows`` (in ratio)."""
        rows = max(1, rows)
        return min(range(len(self.rows)), key=lambda n: abs(math.log(self.rows[n] / rows)))

    @staticmethod
    def _bracket(ladder: list[int], x: float) -> list[tuple[int, float]]:
        """The ladder cells ``x`` is interpolated from, with their weights (summing to 1)."""
        i = bisect.bisect_left(ladder, x)
        if i == 0:
            return [(0, 1.0)]
        if i == len(ladder):
            return [(len(ladder) - 1, 1.0)]
        if ladder[i] == x:
            return [(i, 1.0)]
        w = (x - ladder[i - 1]) / (ladder[i] - ladder[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def observe(self, rows: int, tokens: int, drafted_rows: int, seconds: float,
                draft_seconds: float = 0.0, weight: float = 1.0, drafted_slots: int = 0) -> None:
        """Fold one real step's wall time into the cells it was interpolated from, each in
        proportion to its interpolation weight.

        ``weight`` multiplies the smoothing of this one step (the controller's plain probes).
        ``draft_seconds``: the drafting part of ``seconds`` (``Proposer.draft_seconds``). It
        refines the draft curve (less the measured price of the ``drafted_slots`` beyond one
        per request), and the rest refines the table like any step. (Refining
        the draft curve from the step's time beyond the table's prediction instead made it
        absorb every error of a table that only drafting steps visit: one stream drafting every
        step on an AVX2 CPU had the table's one-row line at 77-80 ms where its steps took 68
        and the draft pass, 6.6-7.8 ms at startup, priced at nothing.)"""
        if rows <= 0 or seconds <= 0:
            return
        if tokens > rows * self.max_per_row or rows > 2 * self.rows[-1]:
            return  # prefill-sized steps are outside the grid the controller decides on
        a = min(1.0, self.smoothing * weight)  # weight: a deliberate measurement counts more
        base = self.step_time(rows, tokens, ordered=False)
        if drafted_rows > 0:
            d = self.row_bucket(drafted_rows)
            # a stall of the machine is not a trend: one step moves the curve boundedly
            extra = self.draft_time(drafted_rows, drafted_slots) - self.draft_time(drafted_rows)
            spent = min(max(0.0, draft_seconds - extra), 2 * self.draft[d] + base)
            self.draft[d] = (1 - a) * self.draft[d] + a * spent
            seconds -= draft_seconds
            if seconds <= 0:
                return
        if base <= 0:
            return
        # one step moves a cell by at most 2**a: a stall of the machine is not a trend
        ratio = min(2.0, max(0.5, seconds / base))
        for i, wi in self._bracket(self.rows, rows):
            if tokens <= rows:
                # a plain step: it measures the level of the whole line (the context lengths
                # and the machine's state of the moment weigh on every block size alike); the
                # extra cost of verification keeps its measured shape until verifying steps
                # refine it. Moving the one-token column alone made plain decoding look slower
                # next to the verification columns (GSM8K, 32 rows: 0.91x no speculation)
                f = ratio ** (a * wi)
                self.table[i] = [f * v for v in self.table[i]]
                continue
            # a verifying step (or a prefill chunk) refines the block sizes, never the
            # plain-decode baseline: its rows cost more than their share of the columns
            t = tokens * self.rows[i] / rows if rows > self.rows[-1] else tokens
            # (none where the line is read below its own plain step: a smaller batch)
            start = bisect.bisect_right(self.tokens, self.rows[i])  # the line's first block
            line = self.table[i]
            cells = self._bracket(self.tokens, t)
            for j, wj in cells:
                if j >= start:
                    line[j] *= ratio ** (a * wi * wj)
            # A block measured cheaper bounds every smaller block of the line (the cells left
            # of the ones just refined; cells on their right are not this step's evidence).
            # The line is read non-decreasing, so a smaller block's stale, higher cell would
            # otherwise set the price of this one for good, and, never chosen at that price,
            # never be measured again. One stream (held-out chat) verified 16-token blocks
            # that took 26 ms for 60 steps at a price of 44.2 ms, the 8-token cell's, stale
            # since a slow spell; with 4 tokens priced 40% above a plain step it verified
            # drafts in 26 steps against 4,575 plain ones (probes only) and served 0.97x no
            # speculation. Only downwards: a cell under-priced this way gets chosen and
            # measured (raising cells on their right for good instead is what the reading
            # avoids, see _line)
            for j in range(cells[0][0] - 1, start - 1, -1):
                if line[j] > line[j + 1]:
                    line[j] = line[j + 1]

    # -- persistence -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "table": self.table,
                "draft": self.draft, "max_per_row": self.max_per_row,
                "draft_slot": self.draft_slot}

    @classmethod
    def from_json(cls, data: dict) -> StepCostModel:
        rows = [int(r) for r in data["rows"]]
        tokens = [int(t) for t in data["tokens"]]
        table = [[float(t) for t in line] for line in data["table"]]
        draft = [float(t) for t in data["draft"]]
        draft_slot = [float(t) for t in data["draft_slot"]]
        max_per_row = int(data["max_per_row"])
        ok = (rows == sorted(set(rows)) and tokens == sorted(set(tokens)) and rows
              and len(tokens) >= 2 and tokens[0] >= 1 and max_per_row >= 1
              and len(table) == len(rows) and len(draft) == len(rows)
              and len(draft_slot) == len(rows)
              and all(len(line) == len(tokens) for line in table)
              and all(t >= 0 and math.isfinite(t) for line in table for t in line)
              and all(t >= 0 and math.isfinite(t) for t in draft + draft_slot))
        if not ok:
            raise ValueError("inconsistent step cost table")
        return cls(rows, tokens, table, draft, max_per_row, draft_slot)

    def describe(self) -> str:
        """One log line: ms per step plain, at the tile edges measured, at the largest block."""
        parts = []
        for i, r in enumerate(self.rows):
            t = np.array([r, *(e for e in (16, 17) if e > r), r * self.max_per_row], float)
            ms = " ".join(f"{int(n)}:{1e3 * v:.1f}" for n, v in zip(t, self._line(i, t)))
            parts.append(f"{r} rows {ms}ms draft +{1e3 * self.draft[i]:.1f}ms "
                         f"+{1e3 * self.draft_slot[i]:.2f}ms/slot")
        return "; ".join(parts)


def read_line(xs: list[int], ys: np.ndarray, t: np.ndarray) -> np.ndarray:
    """A line of cells ``ys`` at token counts ``xs`` read at ``t``: linear between cells,
    past the last with the slope (never negative) from the cell at half its tokens or below:
    across whole tiles, not the last edge (the slope of 64 to 65 tokens, one tile's step,
    once priced 4 rows of 33 tokens at 612 ms)."""
    xs_ = np.asarray(xs, float)
    if len(xs_) == 1:
        return ys[0] * np.maximum(t, xs_[0]) / xs_[0]
    out = np.interp(t, xs_, ys)
    k = _slope_from(xs)
    slope = max(0.0, (ys[-1] - ys[k]) / (xs_[-1] - xs_[k]))
    past = t > xs_[-1]
    out[past] = ys[-1] + slope * (t[past] - xs_[-1])
    return out


def read_point(xs: list[int], ys: list[float], t: float, slope: bool = True) -> float:
    """:func:`read_line` at one ``t`` (pure Python); ``slope`` false: flat past the last
    cell, as ``np.interp``."""
    if len(xs) == 1:
        return ys[0] * max(t, xs[0]) / xs[0]
    if t <= xs[0]:
        return ys[0]
    if t >= xs[-1]:
        if not slope or t == xs[-1]:
            return ys[-1]
        k = _slope_from(xs)
        return ys[-1] + max(0.0, (ys[-1] - ys[k]) / (xs[-1] - xs[k])) * (t - xs[-1])
    j = bisect.bisect_right(xs, t)
    x0, x1 = xs[j - 1], xs[j]
    return ys[j - 1] + (ys[j] - ys[j - 1]) * (t - x0) / (x1 - x0)


def _slope_from(xs: list[int]) -> int:
    """The cell a line's extrapolation slope starts from: the last at half its tokens or
    below (and not the last cell)."""
    return max(0, min(len(xs) - 2, bisect.bisect_right(xs, xs[-1] / 2) - 1))


def token_ladder(rows: list[int], max_per_row: int, max_tokens: int) -> list[int]:
    """Token counts a table is measured at: 1, powers of two, each line's plain step and
    largest block, and both sides of the tile edges, up to the largest step decided on."""
    top = max(2, min(max_tokens, rows[-1] * max_per_row))
    points = {1, *(r for r in rows), *(min(top, r * max_per_row) for r in rows)}
    points |= set(ladder(top)) | {e + d for e in TILE_EDGES for d in (0, 1) if e + d <= top}
    return sorted(p for p in points if p <= top)


def ladder(limit: int, factor: int = 2) -> list[int]:
    out, r = [], 1
    while r < limit:
        out.append(r)
        r *= factor
    out.append(limit)
    return out


def measure_step_costs(
    runner: ModelRunner, blocks: BlockManager, *, max_rows: int, max_per_row: int,
    max_tokens: int, with_draft: bool, vocab_size: int, lookahead: int, max_model_len: int,
    draft_slots: int = 1, repeats: int = 3, time_budget: float = 6.0,
) -> StepCostModel:
    """Time real runner steps on synthetic requests (their pages are scratch: the blocks are
    taken from and returned to the pool before any request arrives).

    Rows are measured from small to large: every decode-sized block of a line while
    ``time_budget`` seconds last, then only each line's plain step, its one-draft-a-row block
    and its draft pass, once each after a warm-up (a few steps a line, however slow the
    machine is at the moment). No line is extrapolated from another: priced in proportion to
    the rows, a line keeps the smaller line's absolute price of an extra token beside a plain
    step ``rows`` times its own, and online refinement, which scales a line's level by its
    plain steps, keeps that shape. (A server whose calibration shared the CPU with another
    server's startup measured one row only and priced 16 rows at 491 ms a plain step and
    +0.3 ms for one more token, where real plain steps took 25-28 ms: it verified drafts at
    almost every step and served 0.63x no speculation at 16 streams.) The draft pass
    is timed with one draft a request and with every draft (``max_per_row - 1``, which need
    ``draft_slots`` slots): the price of a slot is their difference.
    """
    rows_ladder = [r for r in ladder(max_rows, 4) if r <= max_tokens]
    tokens = token_ladder(rows_ladder, max_per_row, max_tokens)
    room = blocks.num_free_blocks * blocks.block_size - max_per_row - lookahead
    ctx = max(1, min(CALIBRATION_CONTEXT, room, max_model_len - max_per_row))
    table_ids: list[int] = []
    blocks.grow(table_ids, ctx + max_per_row + lookahead)
    gen = torch.Generator().manual_seed(0)
    every = max_per_row - 1  # drafts a request makes at most
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    made: list[Request] = []

    def plan_for(rows: int, total: int, draft: int) -> StepPlan:
        """``rows`` requests running ``total`` query tokens, spread evenly (the first rows
        take one more where they do not divide), each then making ``draft`` drafts."""
        plan = StepPlan(scheduled=[])
        for n in range(rows):
            q = total // rows + (n < total % rows)
            prompt = torch.randint(0, vocab_size, (ctx,), generator=gen).tolist()
            req = Request(f"calibrate-{n}", prompt, greedy)
            req.num_computed_tokens = ctx - 1
            req.block_table = table_ids  # shared scratch pages: timing only
            made.append(req)
            spec = torch.randint(0, vocab_size, (q - 1,), generator=gen).tolist()
            plan.scheduled.append(ScheduledRequest(req, q, spec, draft=draft))
        return plan

    def once(plan: StepPlan) -> tuple[float, float]:
        """Seconds of the step and of its drafting part (``Proposer.draft_seconds``)."""
        t0 = time.perf_counter()
        result = runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return time.perf_counter() - t0, result.draft_elapsed

    def run(*plans: StepPlan, repeats: int = repeats) -> tuple[list[float], list[float]]:
        """Best of ``repeats`` for each plan, the plans interleaved (drift hits them alike),
        for the steps and for their drafting parts; each plan is run once first: the first
        calls of a shape pick and build its kernels."""
        best = [float("inf")] * len(plans)
        best_draft = [float("inf")] * len(plans)
        for rep in range(repeats + 1):
            for n, plan in enumerate(plans):
                t, d = once(plan)
                if rep:
                    best[n] = min(best[n], t)
                    best_draft[n] = min(best_draft[n], d)
        return best, best_draft

    try:
        start = time.perf_counter()
        run(plan_for(1, 1, every if with_draft else 0))  # first calls (allocations, threads)
        # Two passes: every line's decode-sized steps first (up to 65 tokens or 4 a row), then
        # the larger blocks while time remains. In one pass, the 16-row line's blocks of 128 to
        # 528 tokens used up the budget and the 64-row line was extrapolated at 97 ms for its
        # plain step (the one-pass per-row ladder had measured 43): read with it, 32-request
        # batches priced a plain step at 49 ms, drafted every step and served 0.86x no
        # speculation
        spans = []
        for rows in rows_ladder:
            limit = min(max_tokens, rows * max_per_row)
            shapes = [t for t in tokens if rows <= t <= limit]
            shapes += [t for t in tokens if t > limit][: max(0, 2 - len(shapes))]
            small = max(4 * rows, TILE_EDGES[-1] + 1)
            spans.append(([t for t in shapes if t <= small], [t for t in shapes if t > small]))
        measured: list[tuple[list[int], list[float]]] = []
        draft: list[float] = []
        draft_slot: list[float] = []
        for rows, (first, _) in zip(rows_ladder, spans):
            spent = time.perf_counter() - start
            rounds = 2 * repeats if rows == 1 else repeats
            if measured and spent > time_budget:
                # Out of time for the whole line, not for its shape: its plain step and one
                # draft a row, once each after a warm-up (the slope past them is read on).
                # Extrapolated in proportion to the 4-row line instead, a 2-vCPU AVX2 EPYC
                # (float32, slow enough that 6 s measured only 1 and 4 rows) priced 16 rows
                # at 184 ms plain and +20% for one draft a row, where real steps took 80-100
                # ms and +45-60%: once plain steps had refined the level down, drafts looked
                # cheap, and 16 streams served 0.90x no speculation
                first = [t for t in first if t in (rows, 2 * rows)] or first[:1]
                rounds = 1
            plans = [plan_for(rows, t, 0) for t in first]
            if with_draft:
                plans.append(plan_for(rows, rows, 1))
                if draft_slots > 1:
                    plans.append(plan_for(rows, rows, every))
            # one row is the cheapest line and the one single streams decide from: twice the
            # rounds (its 8-token price varied by 1.14-1.66x over 3-round calibrations)
            times, proposer = run(*plans, repeats=rounds)
            measured.append((list(first), times[: len(first)]))
            # the draft pass as the proposer times it (Proposer.draft_seconds): the difference
            # of two whole steps, each noisy by milliseconds, once priced a 2.7 ms pass at 4.9
            # and another at 0.0
            one = proposer[len(first)] if with_draft else 0.0
            draft.append(one)
            draft_slot.append(max(0.0, proposer[-1] - one) / (rows * (draft_slots - 1))
                              if with_draft and draft_slots > 1 else 0.0)
        for i, (rows, (_, rest)) in enumerate(zip(rows_ladder, spans)):
            if time.perf_counter() - start > time_budget:
                break
            if rest:
                # with the line's plain step between repeats (its time unused): a plan run
                # twice in a row would give the proposer one request's context twice
                times, _ = run(*[plan_for(rows, t, 0) for t in rest], plan_for(rows, rows, 0))
                times = times[: len(rest)]
                measured[i][0].extend(rest)
                measured[i][1].extend(times)
        table: list[list[float]] = []
        for rows, (shapes, times) in zip(rows_ladder, measured):
            # more query tokens never cost less; timing noise only ever adds time, so where a
            # smaller block measured slower than a larger one, the smaller one was the noisy one
            ys = np.minimum.accumulate(np.asarray(times)[::-1])[::-1]
            # below the plain step: its time; past what was measured: the last measured slope
            t = np.maximum(np.asarray(tokens, float), rows)
            table.append(read_line(shapes, ys, t).tolist())
        # nor do more rows with as many tokens each: a cell measured slower than the same
        # tokens per row on more rows was noise (AVX2 float32 here once measured 4 rows at
        # 154 ms and 16 rows at 130 ms, 4 tokens a row). (Not the same tokens in all: one row
        # of 16 tokens took 23.5 ms where 8 rows of 2 took 23.0.)
        t = np.asarray(tokens, float)
        for i in range(len(table) - 2, -1, -1):
            scale = rows_ladder[i + 1] / rows_ladder[i]
            more = read_line(tokens, np.asarray(table[i + 1]), t * scale)
            table[i] = np.minimum(table[i], more).tolist()
            draft[i] = min(draft[i], draft[i + 1])
        # below its plain step a line is its smaller neighbour's shifted to meet it there (a
        # step costs about a part set by its rows plus a part set by its tokens in all: the
        # products): a batch between two lines with few tokens is read from both at the
        # same tokens, and one of 2 rows verifying a draft priced from a flat 4-row cell
        # would get its extra token for a third of its cost
        for i in range(1, len(table)):
            below = np.asarray(tokens) < rows_ladder[i]
            t = np.array([float(rows_ladder[i])])
            shift = (read_line(tokens, np.asarray(table[i]), t)
                     - read_line(tokens, np.asarray(table[i - 1]), t))[0]
            # (a smaller line timed slower than this one at its plain step, noise on a busy
            # machine, shifts down, but never below the cheapest step of all: one row, one
            # token; a tiny model's sparse lines once shifted cells below zero)
            shifted = np.maximum(np.asarray(table[i - 1]) + shift, table[0][0])
            table[i] = np.where(below, shifted, table[i]).tolist()
        return StepCostModel(rows_ladder, tokens, table, draft, max_per_row, draft_slot)
    finally:
        blocks.free(table_ids)
        for req in made:  # finished: nothing a proposer kept for them is written any more
            req.status = RequestStatus.FINISHED
