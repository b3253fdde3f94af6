"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no phases: each running request asks for the tokens it has not computed yet (a
prefill chunk, 1 for decode, or 1+k when verifying k draft tokens), capped by the budget.
With speculation the scheduler owns the policy: the controller (``engine.spec.controller``)
chooses, per step, how many of its drafts each request verifies and whether it drafts next;
the scheduler writes those choices into the plan and feeds the results back.
"""

from __future__ import annotations

from collections import deque

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.outputs import ScheduledRequest, StepPlan, StepResult
from engine.request import Request, RequestStatus
from engine.spec.controller import Candidate, Decision, SpecController


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, lookahead: int = 0,
                 controller: SpecController | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.lookahead = lookahead  # extra slots a request needs for the next draft block
        self.controller = controller
        self.tree = controller.tree if controller is not None else None  # engine.spec.tree
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark ``req`` finished, drop it from the queues and free its blocks at once."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.spec_token_ids, req.spec_window = [], None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.block_table)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        plan = StepPlan(scheduled=[])
        decisions = self._speculation_decisions()
        fresh = _FreshDrafts(self)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            decision = decisions.get(req.request_id)
            spec = self._trim_spec(req, budget)[: decision.k] if decision is not None else []
            num_new = min(req.num_tokens - req.num_computed_tokens + len(spec), budget)
            if not self._reserve(req, num_new, plan):
                break  # req itself was preempted; everything after it already was
            shape = req.spec_window or self.tree  # this block's layout, else the fixed tree
            parents = shape.window_parents(len(spec)) if shape is not None and spec else None
            draft = decision.draft if decision is not None else fresh(req, num_new)
            plan.scheduled.append(ScheduledRequest(req, num_new, spec, draft, parents))
            budget -= num_new
            i += 1
        while (
            not plan.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.can_grow(req.block_table, self._slots(req, num_new)):
                break
            self.blocks.grow(req.block_table, self._slots(req, num_new))
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.scheduled.append(ScheduledRequest(req, num_new, [], fresh(req, num_new)))
            budget -= num_new
        return plan

    def _speculation_decisions(self) -> dict[str, Decision]:
        """The controller's choice for every running request that will sample this step."""
        ctl = self.controller
        if ctl is None:
            return {}
        cands: list[Candidate] = []
        sampling: list[str] = []
        other = 0
        for req in self.running:
            remaining = req.num_tokens - req.num_computed_tokens
            if req.is_prefilling:
                other += remaining
                continue
            sampling.append(req.request_id)
            window = req.spec_window
            cands.append(Candidate(req.spec_rates, len(req.spec_token_ids),
                                   self._spec_room(req, self.config.max_num_batched_tokens),
                                   remaining, window.confidence if window else None))
        return dict(zip(sampling, ctl.plan(cands, other)))

    def _trim_spec(self, req: Request, budget: int) -> list[int]:
        """Drafts to verify this step, never past the budget, context or ``max_tokens``."""
        if not req.spec_token_ids or req.is_prefilling:
            return []
        return req.spec_token_ids[: self._spec_room(req, budget)]

    def _spec_room(self, req: Request, budget: int) -> int:
        """Drafts ``req`` may verify: within the budget and the context (each draft is a
        row and a slot) and, for the tokens it can add, ``max_tokens``. A tree's leading
        nodes count as many rows as nodes but add at most their depth in tokens."""
        slots = max(0, min(budget - 1, self.config.max_model_len - req.num_tokens))
        depth = slots
        if req.params.max_tokens is not None:
            depth = max(0, min(depth, req.params.max_tokens - req.num_output_tokens - 1))
        if req.spec_window is not None:  # drafts laid out per block (engine.spec.tree_order)
            return req.spec_window.nodes_within(len(req.spec_token_ids), depth, slots)
        return depth if self.tree is None else self.tree.nodes_within(depth, slots)

    def _slots(self, req: Request, num_new: int) -> int:
        end = req.num_computed_tokens + num_new
        return end + (self.lookahead if end >= req.num_tokens else 0)

    def _reserve(self, req: Request, num_new: int, plan: StepPlan) -> bool:
        """Grow ``req``'s table, preempting the newest running requests while blocks lack."""
        slots = self._slots(req, num_new)
        while not self.blocks.can_grow(req.block_table, slots):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is req:
                return False
        self.blocks.grow(req.block_table, slots)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.block_table)
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_window = [], None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results --------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> dict[str, list[int]]:
        """Advance lengths, append sampled tokens and apply token-level stop conditions.

        Returns the tokens appended per request (after truncation at a stop).
        """
        appended: dict[str, list[int]] = {}
        ctl = self.controller
        expected, produced, decoding = 0.0, 0, 0  # what speculation promised and delivered
        if ctl is not None:
            drafting = [item.draft for item in plan.scheduled if item.draft and item.samples]
            drafted, slots = len(drafting), sum(ctl.draft_slots(n) for n in drafting)
            verified = sum(len(item.spec_token_ids) for item in plan.scheduled)
        for item in plan.scheduled:
            req = item.request
            if req.is_finished or req.status != RequestStatus.RUNNING:
                continue
            rid = req.request_id
            accepted = result.num_accepted.get(rid, 0)
            req.num_computed_tokens += item.num_valid(accepted)
            if ctl is not None and rid in result.sampled:
                # (the window verified: the one kept with the drafts last step)
                held = req.spec_window.confidence if req.spec_window is not None else None
                expected += ctl.expected_tokens(req.spec_rates, len(item.spec_token_ids), held)
                produced += 1 + accepted
                decoding += item.num_new_tokens == 1 + len(item.spec_token_ids)
                if req.spec_rates is None:
                    req.spec_rates = ctl.acceptance.new_request()
                ctl.observe(req.spec_rates, len(item.spec_token_ids), accepted,
                            result.accepted_paths.get(rid), held)
            req.spec_token_ids, req.spec_window = [], None
            tokens = result.sampled.get(rid, [])
            logprobs = result.logprobs.get(rid)
            kept = self._append(req, tokens, logprobs)
            appended[rid] = kept
            if not req.is_finished and kept:
                req.spec_token_ids = list(result.drafts.get(rid, []))
                req.spec_window = result.draft_windows.get(rid)
        if ctl is not None:
            # only decode steps (no prefill chunk, not the last chunk of one, no vanished
            # request) are what the controller chooses between
            whole = decoding == len(plan.scheduled)
            ctl.observe_step(len(plan.scheduled), plan.num_tokens, drafted, result.elapsed,
                             draft_seconds=result.draft_elapsed, drafted_slots=slots,
                             verified=verified, expected=expected if whole else None,
                             produced=produced if whole else None)
        return appended

    def _append(self, req: Request, tokens: list[int], logprobs: list | None) -> list[int]:
        params = req.params
        kept: list[int] = []
        for j, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[j])
            kept.append(tok)
            if not params.ignore_eos and tok in req.eos_token_ids:
                self.finish(req, "stop", None)
            elif tok in params.stop_token_ids:
                self.finish(req, "stop", tok)
            elif params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
                self.finish(req, "length")
            elif req.num_tokens >= self.config.max_model_len:
                self.finish(req, "length")
            if req.is_finished:
                break
        return kept


class _FreshDrafts:
    """The drafts a request sampling for the first time this step (the end of its prefill)
    makes (0: none): asked of the controller at most once per step, and only when such a request is
    scheduled (most steps under load have none; the question prices a whole batch)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.answer: int | None = None

    def __call__(self, req: Request, num_new: int) -> int:
        ctl = self.sched.controller
        if ctl is None or req.num_computed_tokens + num_new < req.num_tokens:
            return 0  # no controller, or a prefill chunk that samples nothing
        if self.answer is None:
            # judged at the batch the request joins: when a wave arrives at once, the first
            # admitted must not draft as if alone (a draft pass and context writes for the
            # whole wave at its first token, which a full batch does not repay)
            s = self.sched
            joined = min(s.config.max_num_seqs, len(s.running) + len(s.waiting))
            self.answer = ctl.fresh_request_drafts(joined)
        return self.answer
