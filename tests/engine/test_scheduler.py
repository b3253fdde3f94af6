"""Scheduler behaviour with a scripted, model-free runner (see ``scripted_runner.py``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_runner import (
    WRONG,
    ScriptedRunner,
    drive,
    make_request,
    make_scheduler,
    script_for,
)

from engine.outputs import ScheduledRequest, StepPlan, StepResult
from engine.request import RequestStatus
from engine.spec.acceptance import AcceptanceModel
from engine.spec.controller import SpecController
from engine.spec.stats import SpecDecodingStats

EOS = 2


def scripts(*rids: str, length: int = 64) -> dict[str, list[int]]:
    return {r: script_for(r, length) for r in rids}


def step(sched, runner):
    plan = sched.schedule()
    result = runner.execute(plan)
    appended = sched.update(plan, result)
    return plan, result, appended


# --------------------------------------------------------------------------- admission


def test_admission_respects_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        sched.add(make_request(rid, 4, max_tokens=3))
    runner = ScriptedRunner(scripts(*rids), block_size=4)
    first = sched.schedule()
    assert [s.request_id for s in first.scheduled] == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    sched.update(first, runner.execute(first))
    per_step = []
    drive(sched, runner, each_step=lambda p: per_step.append(len(p.scheduled)))
    assert max(per_step) <= 2
    # FIFO: a request is first scheduled only after an earlier one
    order = []
    for plan in runner.plans:
        for s in plan.scheduled:
            if s.request_id not in order:
                order.append(s.request_id)
    assert order == rids


def test_a_wave_is_judged_for_drafting_at_the_batch_it_forms() -> None:
    """Requests arriving together draft at their first token only if drafting pays at the
    batch they form (capped at max_num_seqs), not as if the first admitted were alone."""
    seen: list[int] = []

    class Recording(SpecController):
        def fresh_request_drafts(self, batch_rows: int) -> int:
            seen.append(batch_rows)
            return 2 if batch_rows < 4 else 0  # drafting pays below four rows

    ctl = Recording(2, AcceptanceModel(2), None, SpecDecodingStats(2), adaptive=False)
    sched = make_scheduler(max_num_seqs=6, max_num_batched_tokens=12, controller=ctl)
    for i in range(9):
        sched.add(make_request(f"r{i}", 4))
    plan = sched.schedule()  # the budget admits three of the nine
    assert len(plan.scheduled) == 3 and seen == [6]
    assert not any(item.draft for item in plan.scheduled)
    seen.clear()
    alone = make_scheduler(max_num_seqs=6, max_num_batched_tokens=12, controller=ctl)
    alone.add(make_request("solo", 4))
    plan = alone.schedule()
    assert seen == [1] and plan.scheduled[0].draft


def test_fresh_drafting_is_asked_only_when_a_request_samples_its_first_token() -> None:
    """The question prices a whole batch, so it is asked once for a step that ends some
    prefill, and never for one that only decodes or runs prefill chunks that sample nothing."""
    seen: list[int] = []

    class Recording(SpecController):
        def fresh_request_drafts(self, batch_rows: int) -> int:
            seen.append(batch_rows)
            return 2

    ctl = Recording(2, AcceptanceModel(2), None, SpecDecodingStats(2), adaptive=False)
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8, controller=ctl)
    sched.add(make_request("long", 20, max_tokens=4))
    runner = ScriptedRunner(scripts("long", "short", "late"), block_size=4)
    plan, _, _ = step(sched, runner)  # a chunk of 8: no token sampled
    assert seen == [] and not plan.scheduled[0].draft
    step(sched, runner)
    plan, _, _ = step(sched, runner)  # the last chunk: the first token, drafted at once
    assert seen == [1] and plan.scheduled[0].draft
    sched.add(make_request("short", 3, max_tokens=4))
    sched.add(make_request("late", 3, max_tokens=4))  # waits: max_num_seqs is 2
    plan, _, _ = step(sched, runner)  # "short" ends its prefill in a batch of two
    assert seen == [1, 2] and [s.draft for s in plan.scheduled] == [2, 2]
    step(sched, runner)  # both decode, "late" still waits
    assert seen == [1, 2]


def test_admission_respects_token_budget_and_chunks_the_last_admitted() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=10)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, 6, max_tokens=2))
    plan = sched.schedule()
    got = [(s.request_id, s.num_new_tokens) for s in plan.scheduled]
    assert got == [("a", 6), ("b", 4)]  # b gets the rest of the budget as a first chunk
    assert plan.num_tokens == 10
    assert [s.samples for s in plan.scheduled] == [True, False]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_chunked_prefill_of_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=64)
    long = make_request("long", 50, max_tokens=3)
    sched.add(long)
    seen = []  # (computed before, num_new, samples) per step, recorded before update
    runner = ScriptedRunner(
        scripts("long"), block_size=4,
        on_plan=lambda p: seen.append((p.scheduled[0].request.num_computed_tokens,
                                       p.scheduled[0].num_new_tokens, p.scheduled[0].samples)))
    while long.num_output_tokens == 0:
        plan, _, _ = step(sched, runner)
        assert plan.num_tokens <= 16
        assert len(long.block_table) * 4 >= long.num_computed_tokens
    # split 16 + 16 + 16 + 2; no token sampled before the last chunk
    assert seen == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert long.num_computed_tokens == 50 and long.num_output_tokens == 1
    drive(sched, runner)
    assert long.output_token_ids == script_for("long")[:3]


def test_budget_shared_between_decodes_and_a_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=12, num_blocks=64)
    rids = ["d1", "d2", "big"]
    sched.add(make_request("d1", 3, max_tokens=10))
    sched.add(make_request("d2", 3, max_tokens=10))
    runner = ScriptedRunner(scripts(*rids), block_size=4)
    step(sched, runner)  # both prefills
    sched.add(make_request("big", 40, max_tokens=2))
    plan, _, _ = step(sched, runner)
    got = {s.request_id: s.num_new_tokens for s in plan.scheduled}
    assert got == {"d1": 1, "d2": 1, "big": 10}
    drive(sched, runner)
    for p in runner.plans:
        assert p.num_tokens <= 12


# --------------------------------------------------------------------------- preemption


def test_preemption_by_recompute_newest_first() -> None:
    # 6 blocks of 4 tokens: a, b and c each need 2 blocks to start, then grow while decoding
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64,
                           max_num_seqs=3)
    rids = ["a", "b", "c", "d"]
    for rid in rids:
        sched.add(make_request(rid, 7, max_tokens=12))
    runner = ScriptedRunner(scripts(*rids), block_size=4)
    step(sched, runner)
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    assert [r.request_id for r in sched.waiting] == ["d"]  # over max_num_seqs
    assert sched.blocks.num_free_blocks == 0
    # decode: a's 8th position fits in its second block; position 8 (9th token) needs a third
    plan, _, _ = step(sched, runner)
    assert plan.preempted == []
    plan, _, _ = step(sched, runner)
    assert plan.preempted == ["c"], "the most recently admitted running request goes first"
    c = next(r for r in sched.waiting if r.request_id == "c")
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # requeued at the front
    assert c.status == RequestStatus.WAITING
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions >= 1
    assert len(c.output_token_ids) == 2  # its tokens are kept for recompute
    assert "c" not in {s.request_id for s in plan.scheduled}
    used = sum(len(r.block_table) for r in sched.running)
    assert used == sched.blocks.num_used_blocks
    drive(sched, runner)
    for rid in rids:
        req = next(p.request for plan in runner.plans for p in plan.scheduled
                   if p.request_id == rid)
        assert req.output_token_ids == script_for(rid)[:12], rid
        assert req.finish_reason == "length"
    assert sched.blocks.num_used_blocks == 0


def test_preempted_request_recomputes_prompt_and_outputs() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, 7, max_tokens=12))
    seen = []  # (computed, num_tokens, num_new, samples) of c at each plan, before update

    def record(plan: StepPlan) -> None:
        for item in plan.scheduled:
            if item.request_id == "c":
                r = item.request
                seen.append((r.num_computed_tokens, r.num_tokens, item.num_new_tokens,
                             item.samples, r.num_preemptions))

    runner = ScriptedRunner(scripts("a", "b", "c"), block_size=4, on_plan=record)
    drive(sched, runner)
    after = [s for s in seen if s[4] > 0]
    assert after, "c was never preempted"
    computed, num_tokens, num_new, samples, _ = after[0]
    # the first chunk after preemption restarts at 0 and recomputes prompt + outputs
    assert computed == 0 and num_new == num_tokens > 7 and samples


def test_victim_is_the_running_request_itself_when_it_is_newest() -> None:
    """a (older) still fits its blocks; b (newest) needs a block and none is free: b preempts
    itself, a keeps running, and b completes later by recompute."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64,
                           max_model_len=16)
    sched.add(make_request("a", 5, max_tokens=8))  # 2 blocks, grows at position 8
    sched.add(make_request("b", 8, max_tokens=6))  # 2 blocks, grows at once
    plans = []
    runner = ScriptedRunner(
        scripts("a", "b"), block_size=4,
        on_plan=lambda p: plans.append(([s.request_id for s in p.scheduled], list(p.preempted))))
    drive(sched, runner)
    assert plans[0] == (["a", "b"], [])
    assert plans[1] == (["a"], ["b"])
    assert sched.num_preemptions >= 1
    reqs = {p.request_id: p.request for plan in runner.plans for p in plan.scheduled}
    assert reqs["a"].output_token_ids == script_for("a")[:8]
    assert reqs["b"].output_token_ids == script_for("b")[:6]
    assert reqs["b"].num_preemptions >= 1
    assert sched.blocks.num_used_blocks == 0


# --------------------------------------------------------------------------- stop conditions


def test_stop_on_eos() -> None:
    sched = make_scheduler()
    req = make_request("a", 5, max_tokens=20, eos=(EOS,))
    sched.add(req)
    script = script_for("a")
    script[3] = EOS
    drive(sched, ScriptedRunner({"a": script}, block_size=4))
    assert req.output_token_ids == script[:4]  # EOS is part of the output
    assert (req.finish_reason, req.stop_reason) == ("stop", None)
    assert sched.blocks.num_used_blocks == 0


def test_ignore_eos_runs_to_max_tokens() -> None:
    sched = make_scheduler()
    req = make_request("a", 5, max_tokens=8, eos=(EOS,), ignore_eos=True)
    sched.add(req)
    script = script_for("a")
    script[1] = script[3] = EOS
    drive(sched, ScriptedRunner({"a": script}, block_size=4))
    assert req.output_token_ids == script[:8]
    assert req.finish_reason == "length"


def test_stop_token_ids_set_stop_reason() -> None:
    sched = make_scheduler()
    script = script_for("a")
    req = make_request("a", 5, max_tokens=20, stop_token_ids=[script[4], 9999])
    sched.add(req)
    drive(sched, ScriptedRunner({"a": script}, block_size=4))
    assert req.output_token_ids == script[:5]
    assert (req.finish_reason, req.stop_reason) == ("stop", script[4])


def test_max_tokens_finishes_with_length() -> None:
    sched = make_scheduler()
    req = make_request("a", 5, max_tokens=7)
    sched.add(req)
    drive(sched, ScriptedRunner(scripts("a"), block_size=4))
    assert req.output_token_ids == script_for("a")[:7]
    assert (req.finish_reason, req.stop_reason) == ("length", None)


def test_max_model_len_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=12)
    req = make_request("a", 5, max_tokens=None)
    sched.add(req)
    drive(sched, ScriptedRunner(scripts("a"), block_size=4))
    assert req.num_tokens == 12
    assert req.finish_reason == "length"


def _verify_step(rid: str, prompt_len: int, num_out: int, spec: list[int], max_tokens: int,
                 sampled: list[int], **params):
    """A request with ``num_out`` outputs already, a verify window of ``spec`` scheduled by
    hand, and ``sampled`` returned for it."""
    sched = make_scheduler()
    req = make_request(rid, prompt_len, max_tokens=max_tokens, **params)
    sched.add(req)
    sched.schedule()  # admit and allocate
    req.output_token_ids = list(range(300, 300 + num_out))
    req.num_computed_tokens = req.num_tokens - 1
    sched.blocks.grow(req.block_table, req.num_tokens + len(spec))
    plan = StepPlan([ScheduledRequest(req, 1 + len(spec), list(spec))])
    result = StepResult(sampled={rid: sampled}, num_accepted={rid: len(sampled) - 1},
                        drafts={rid: [1, 2, 3]})
    appended = sched.update(plan, result)
    return sched, req, appended


def test_max_tokens_in_the_middle_of_an_accepted_block() -> None:
    sched, req, appended = _verify_step("a", 5, 3, [401, 402, 403, 404], max_tokens=5,
                                        sampled=[401, 402, 403, 404, 405])
    assert req.output_token_ids == [300, 301, 302, 401, 402]  # exactly max_tokens
    assert appended["a"] == [401, 402]
    assert req.finish_reason == "length"
    assert req.spec_token_ids == []  # no new drafts for a finished request
    assert sched.blocks.num_used_blocks == 0


def test_stop_token_in_the_middle_of_an_accepted_block() -> None:
    sched, req, appended = _verify_step("a", 5, 0, [401, 402, 403], max_tokens=20,
                                        sampled=[401, 402, 403, 404], stop_token_ids=[402])
    assert req.output_token_ids == [401, 402]
    assert (req.finish_reason, req.stop_reason) == ("stop", 402)
    assert appended["a"] == [401, 402]


def test_eos_in_the_middle_of_an_accepted_block() -> None:
    sched, req, _ = _verify_step("a", 5, 0, [401, EOS, 403], max_tokens=20,
                                 sampled=[401, EOS, 403, 404], eos=(EOS,))
    assert req.output_token_ids == [401, EOS]
    assert (req.finish_reason, req.stop_reason) == ("stop", None)


def test_partial_acceptance_rolls_back_length_and_keeps_new_drafts() -> None:
    sched, req, appended = _verify_step("a", 5, 2, [401, 402, 403, 404], max_tokens=20,
                                        sampled=[401, 402, 999])
    assert req.output_token_ids == [300, 301, 401, 402, 999]
    assert req.num_computed_tokens == req.num_tokens - 1 == 5 + 5 - 1
    assert req.spec_token_ids == [1, 2, 3]
    assert not req.is_finished


# --------------------------------------------------------------------------- speculation


def test_spec_drafts_trimmed_by_max_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    req = make_request("a", 5, max_tokens=7)
    sched.add(req)
    windows_at = []
    runner = ScriptedRunner(
        scripts("a"), block_size=4, num_spec=4,
        on_plan=lambda p: windows_at.append((p.scheduled[0].request.num_output_tokens,
                                             len(p.scheduled[0].spec_token_ids))))
    drive(sched, runner)
    windows = [n for _, n in windows_at]
    # prefill samples 1 and proposes 4; 1 + 4 + 1 = 6 outputs, then only 0 drafts fit (7 - 6 - 1)
    assert windows == [0, 4, 0]
    assert req.output_token_ids == script_for("a")[:7]
    for n_out, n_spec in windows_at:
        assert n_out + n_spec + 1 <= 7


def test_spec_drafts_trimmed_by_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=3)
    req = make_request("a", 2, max_tokens=30)
    sched.add(req)
    runner = ScriptedRunner(scripts("a"), block_size=4, num_spec=5)
    drive(sched, runner)
    for p in runner.plans:
        item = p.scheduled[0]
        assert item.num_new_tokens <= 3
        assert len(item.spec_token_ids) <= 2
    assert any(len(p.scheduled[0].spec_token_ids) == 2 for p in runner.plans)
    assert req.output_token_ids == script_for("a")[:30]


def test_spec_drafts_trimmed_by_max_model_len() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=16)
    req = make_request("a", 8, max_tokens=None)
    sched.add(req)
    ends = []
    runner = ScriptedRunner(
        scripts("a"), block_size=4, num_spec=6,
        on_plan=lambda p: ends.append(p.scheduled[0].request.num_computed_tokens
                                      + p.scheduled[0].num_new_tokens))
    drive(sched, runner)
    assert max(ends) <= 16  # the window's positions stay inside max_model_len
    assert req.num_tokens == 16 and req.finish_reason == "length"
    assert req.output_token_ids == script_for("a")[:8]


@pytest.mark.parametrize("reject_at", [[0], [1], [2, 0, 3], [4]])
def test_lengths_rolled_back_after_partial_acceptance(reject_at) -> None:
    sched = make_scheduler(max_num_batched_tokens=64, lookahead=0)
    reqs = [make_request(rid, 6 + i, max_tokens=25) for i, rid in enumerate(("a", "bb"))]
    for r in reqs:
        sched.add(r)
    runner = ScriptedRunner(scripts("a", "bb"), block_size=4, num_spec=4,
                            reject_at={"a": reject_at, "bb": list(reversed(reject_at))})
    accepted_seen = []

    def check(plan: StepPlan) -> None:
        for item in plan.scheduled:
            r = item.request
            if item.samples and not r.is_finished:
                assert r.num_computed_tokens == r.num_tokens - 1, r.request_id
            if item.spec_token_ids:
                accepted_seen.append(item.spec_token_ids)

    drive(sched, runner, each_step=check)
    assert accepted_seen, "no verify window was scheduled"
    for r in reqs:
        assert r.output_token_ids == script_for(r.request_id)[:25]  # never corrupted
    assert sched.blocks.num_used_blocks == 0


def test_verify_window_holds_lookahead_slots() -> None:
    look = 5
    sched = make_scheduler(max_num_batched_tokens=64, lookahead=look, block_size=4)
    req = make_request("a", 7, max_tokens=12)
    sched.add(req)
    runner = ScriptedRunner(scripts("a"), block_size=4, num_spec=3, lookahead=look)
    drive(sched, runner)  # the runner asserts table coverage (length + drafts + look-ahead)
    assert any(p.scheduled[0].spec_token_ids for p in runner.plans)


def test_finished_request_is_not_scheduled_again() -> None:
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=1)
    sched.add(req)
    runner = ScriptedRunner(scripts("a"), block_size=4)
    step(sched, runner)
    assert req.is_finished
    assert sched.schedule().is_empty
    sched.add(make_request("b", 2))
    with pytest.raises(ValueError, match="already in use"):  # ids are unique while in use
        sched.add(make_request("b", 2))


# --------------------------------------------------------------------------- randomized


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 24), min_size=8, max_size=8),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    num_spec=st.integers(0, 3),
    extra_blocks=st.integers(0, 6),
    reject=st.lists(st.integers(0, 3), min_size=1, max_size=4),
)
def test_random_workloads_complete_with_scripted_tokens(
    prompts, max_tokens, budget, max_num_seqs, num_spec, extra_blocks, reject
) -> None:
    bs, max_len, look = 4, 64, num_spec
    # enough for one max_model_len request plus look-ahead (what plan_pool guarantees)
    num_blocks = -(-(max_len + look) // bs) + extra_blocks
    sched = make_scheduler(num_blocks=num_blocks, block_size=bs, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget, max_model_len=max_len,
                           lookahead=look)
    rids = [f"r{i}" for i in range(len(prompts))]
    reqs = [make_request(rid, n, max_tokens=max_tokens[i])
            for i, (rid, n) in enumerate(zip(rids, prompts))]
    for r in reqs:
        sched.add(r)
    runner = ScriptedRunner(scripts(*rids), block_size=bs, num_spec=num_spec,
                            reject_at={rid: reject for rid in rids}, lookahead=look)
    drive(sched, runner, max_steps=3000)
    for r in reqs:
        assert r.output_token_ids == script_for(r.request_id)[: r.params.max_tokens]
        assert r.finish_reason == "length"
        assert WRONG not in r.output_token_ids
    assert sched.blocks.num_used_blocks == 0
