"""A model-free runner for scheduler tests.

Each request has a scripted output sequence: the token at output index ``i`` is
``script[rid][i]`` whatever happened before (preemption, chunking, batching), which is what a
deterministic greedy model would do. Drafts are the next scripted tokens with one deliberately
wrong token at a scripted index, so the number of accepted drafts per step is scripted too,
and the runner verifies exactly like sample-and-compare: a draft is accepted while it equals
the scripted token at its position.

The runner also simulates the paged KV cache (``slot -> (request, position, token)``) and
checks, before every chunk, that all earlier positions of the request are present in its
slots: a block freed too early, handed to two requests, or a length not rolled back after
rejection shows up as a stale or foreign entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.outputs import StepPlan, StepResult
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec.acceptance import AcceptanceModel
from engine.spec.controller import SpecController
from engine.spec.stats import SpecDecodingStats

WRONG = 10_000  # a token id no script uses


@dataclass
class ScriptedRunner:
    scripts: dict[str, list[int]]
    block_size: int
    num_spec: int = 0  # drafts proposed after each sampled token (0: no speculation)
    # rid -> list of "index of the first wrong draft" per proposal (cycled); default: all right
    reject_at: dict[str, list[int]] = field(default_factory=dict)
    lookahead: int = 0
    on_plan: Callable[[StepPlan], None] | None = None
    cache: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    proposals: dict[str, int] = field(default_factory=dict)

    def slot(self, req: Request, pos: int) -> int:
        bs = self.block_size
        return req.block_table[pos // bs] * bs + pos % bs

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        if self.on_plan is not None:
            self.on_plan(plan)
        result = StepResult(sampled={})
        owners: dict[int, str] = {}
        for item in plan.scheduled:
            req, rid = item.request, item.request_id
            for blk in req.block_table:
                assert owners.setdefault(blk, rid) == rid, f"block {blk} in two tables"
            start, n = req.num_computed_tokens, item.num_new_tokens
            spec = list(item.spec_token_ids)
            known = n - len(spec)
            assert n >= 1
            assert known >= 1 and start + known <= req.num_tokens
            # the table covers every position run this step (plus look-ahead when at the end)
            need = start + n + (self.lookahead if start + n >= req.num_tokens else 0)
            assert len(req.block_table) * self.block_size >= need, (
                f"{rid}: table of {len(req.block_table)} blocks for {need} slots"
            )
            context = req.tokens(0, start)
            for p in range(start):  # context must be intact
                got = self.cache.get(self.slot(req, p))
                assert got == (rid, p, context[p]), (
                    f"{rid}: position {p} holds {got}, expected {(rid, p, context[p])}"
                )
            tokens = req.tokens(start, start + known) + spec
            for j, tok in enumerate(tokens):
                self.cache[self.slot(req, start + j)] = (rid, start + j, tok)
            if not item.samples:
                continue
            script = self.scripts[rid]
            n_out = req.num_output_tokens
            accepted = 0
            while accepted < len(spec) and spec[accepted] == script[n_out + accepted]:
                accepted += 1
            sampled = script[n_out : n_out + accepted + 1]
            result.sampled[rid] = sampled
            result.num_accepted[rid] = accepted
            if self.num_spec:
                result.drafts[rid] = self._propose(rid, n_out + len(sampled))
        return result

    def _propose(self, rid: str, next_index: int) -> list[int]:
        script = self.scripts[rid]
        drafts = script[next_index : next_index + self.num_spec]
        drafts += [WRONG] * (self.num_spec - len(drafts))
        pattern = self.reject_at.get(rid)
        if pattern:
            k = self.proposals.get(rid, 0)
            self.proposals[rid] = k + 1
            bad = pattern[k % len(pattern)]
            if bad < len(drafts):
                drafts[bad] = WRONG
        return drafts


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   lookahead: int = 0, controller: SpecController | None = None) -> Scheduler:
    """A scheduler whose speculation (when a test gives requests drafts) verifies every draft
    it can, unless the test passes its own controller."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    if controller is None:
        controller = fixed_k_controller(64)
    return Scheduler(config, BlockManager(num_blocks, block_size), lookahead, controller)


def fixed_k_controller(k: int) -> SpecController:
    return SpecController(k, AcceptanceModel(k), None, SpecDecodingStats(k), adaptive=False)


def make_request(rid: str, prompt_len: int, max_tokens: int | None = 8, eos: tuple = (),
                 **params) -> Request:
    prompt = [100 + (7 * i + len(rid)) % 50 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos)


def script_for(rid: str, length: int = 64) -> list[int]:
    """Distinct, non-special tokens per request (ids >= 200, never EOS-like)."""
    seed = sum(ord(c) for c in rid)
    return [200 + (seed * 31 + 17 * i) % 500 for i in range(length)]


def drive(sched: Scheduler, runner: ScriptedRunner, max_steps: int = 2000,
          each_step: Callable[[StepPlan], None] | None = None) -> int:
    """Run the scheduler to completion; returns the number of steps."""
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        assert not plan.is_empty, "scheduler made no progress"
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        result = runner.execute(plan)
        sched.update(plan, result)
        if each_step is not None:
            each_step(plan)
        steps += 1
        assert steps < max_steps, "did not finish"
    return steps
