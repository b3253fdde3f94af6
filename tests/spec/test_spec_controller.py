"""The speculation controller, its acceptance model and its cost model, with injected inputs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.spec.acceptance import (
    AcceptanceModel,
    ConfidenceScale,
    expected_gains,
    load_seed_curve,
)
from engine.spec.controller import Candidate, SpecController
from engine.spec.cost import StepCostModel
from engine.spec.realized import RealizedGain
from engine.spec.stats import SpecDecodingStats
from engine.spec.tree import DraftTree, slots_needed

K = 7


def cost_model(per_token: float, draft: float, base: float = 0.02) -> StepCostModel:
    """Step time ``base * rows + per_token * extra tokens``, and ``draft`` per drafting row."""
    rows, tokens = [1, 4, 16, 64], [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    # (below a line's plain step, rows x 1 token: the 1-row line shifted to meet it)
    table = [[base * r + per_token * (t - r) for t in tokens] for r in rows]
    return StepCostModel(rows, tokens, table, [draft * r for r in rows], max_per_row=8)


def controller(acceptance: float, per_token: float, draft: float, **kw) -> SpecController:
    return SpecController(K, AcceptanceModel(K, [acceptance] * K), cost_model(per_token, draft),
                          SpecDecodingStats(K), **kw)


def decode(n: int, available: int = K, cap: int = K) -> list[Candidate]:
    return [Candidate(None, available, cap, 1) for _ in range(n)]


def test_no_drafts_when_acceptance_is_near_zero():
    ctl = controller(acceptance=0.01, per_token=0.001, draft=0.002)
    for _ in range(5):
        assert all(d.k == 0 and not d.draft for d in ctl.plan(decode(4)))


def test_no_drafts_when_verification_is_expensive():
    # each extra query token costs as much as a whole decode row: nothing pays at a = 0.6
    ctl = controller(acceptance=0.6, per_token=0.02, draft=0.0)
    assert all(d.k == 0 for d in ctl.plan(decode(2)))


def test_all_drafts_when_verification_is_free_and_acceptance_high():
    ctl = controller(acceptance=0.95, per_token=0.0, draft=0.0)
    assert all(d.k == K and d.draft for d in ctl.plan(decode(8)))


def test_moderate_cost_picks_an_interior_k():
    # gains 0.7, 0.49, 0.34, 0.24, ...: with each token costing 10% of a decode step, the rate
    # (1 + sum of gains) / (1 + 0.1 k) is 1.95, 1.98, 1.96 at k = 3, 4, 5: k = 4
    ctl = controller(acceptance=0.7, per_token=0.002, draft=0.0)
    assert [d.k for d in ctl.plan(decode(1))] == [4]


def test_caps_and_available_drafts_bound_the_choice():
    ctl = controller(acceptance=0.95, per_token=0.0, draft=0.0)
    cands = [Candidate(None, 2, K, 1), Candidate(None, K, 3, 1), Candidate(None, 0, K, 1)]
    decisions = ctl.plan(cands)
    assert [d.k for d in decisions] == [2, 3, 0]
    assert decisions[2].draft  # holds nothing now, drafts for the next step


def test_held_drafts_are_verified_by_their_blocks_confidence():
    """Drafts laid out per block (engine.spec.tree_order) carry their block's confidence: the
    drafts verified now follow it (a confident block verifies deep, a doubtful one nothing),
    while the drafts made for the next step still follow the acceptance model."""
    ctl = controller(acceptance=0.7, per_token=0.002, draft=0.0)
    confident = Candidate(None, K, K, 1, [0.99, 0.98, 0.97, 0.96, 0.95, 0.9, 0.9])
    doubtful = Candidate(None, K, K, 1, [0.05, 0.02, 0.01, 0.0, 0.0, 0.0, 0.0])
    (sure,) = ctl.plan([confident])
    assert sure.k == K and sure.draft == 4  # the model's gains alone verify 4 (see above)
    assert ctl.plan([doubtful])[0].k == 0
    # two requests: the batch's extra tokens go to the confident one
    d = ctl.plan([confident, doubtful])
    assert d[0].k > 0 and d[1].k == 0
    assert ctl.expected_tokens(None, 2, confident.confidence) == pytest.approx(1 + 0.99 + 0.98)


def test_confidence_scale_follows_what_verification_accepts():
    """A draft more confident than it is accepted (1.6 drafts promised, 1 accepted) is scaled
    down towards 1 / 1.6 (as far as the prior's 16 drafts let 200 windows' worth of evidence);
    one window moves the scale a little; gains stay at most 1."""
    scale = ConfidenceScale()
    assert scale.factor == 1.0 and scale.gains([0.5, 0.25]) == [0.5, 0.25]
    scale.observe([0.8, 0.6], 0)
    assert 0.8 < scale.factor < 1.0
    for _ in range(2000):
        scale.observe([0.8, 0.6, 0.2], 1)  # 1.6 promised, 1 delivered
    # (the decayed sums: 1 and 1.6 per window over 200 windows' worth, with the prior)
    assert scale.factor == pytest.approx((1 / 0.005 + 16) / (1.6 / 0.005 + 16), rel=1e-3)
    for _ in range(2000):
        scale.observe([0.4, 0.2], 1)  # 0.6 promised, 1 delivered
    assert scale.factor > 1.5 and scale.gains([0.9, 0.5])[0] == 1.0


def test_batch_level_choice_spends_extra_tokens_on_the_best_requests():
    good = AcceptanceModel(K, [0.9] * K)
    ctl = SpecController(K, good, cost_model(0.004, 0.0), SpecDecodingStats(K))
    bad_state = good.new_request()
    for _ in range(30):  # this request's drafts keep failing at the first position
        good.observe(bad_state, K, 0)
    cands = [Candidate(bad_state, K, K, 1), Candidate(good.new_request(), K, K, 1)]
    ks = [d.k for d in ctl.plan(cands)]
    assert ks[0] == 0 and ks[1] > 0


def test_drafts_already_paid_for_are_verified_even_when_new_drafts_do_not_pay():
    # verification is free but the draft pass is expensive: no new drafts, but the ones held
    # now were paid for last step and are verified
    ctl = controller(acceptance=0.5, per_token=0.0, draft=1.0)
    decisions = ctl.plan(decode(1))
    assert decisions[0].k > 0 and not decisions[0].draft


def test_probes_resume_drafting_with_backoff():
    ctl = controller(acceptance=0.01, per_token=0.001, draft=0.01, probe_interval=4,
                     max_probe_interval=16)
    drafted_at = [step for step in range(1, 60)
                  if any(d.draft for d in ctl.plan(decode(2, available=0)))]
    # probes at 4, then 4 + 8, then every 16 (the interval doubles while nothing pays)
    assert drafted_at == [4, 12, 28, 44]


def test_the_step_after_a_probe_verifies_its_drafts_and_refined_costs_are_saved():
    ctl = controller(acceptance=0.01, per_token=0.02, draft=0.01, probe_interval=2)
    assert [d.k for d in ctl.plan(decode(2))] == [0, 0]
    assert [d.draft for d in ctl.plan(decode(2))] == [K, 0]  # the probe: one request, all drafts
    # its drafts, verified whole (every position and the largest block measured; the other
    # request holds none), within the request's cap
    assert [d.k for d in ctl.plan([Candidate(None, K, 5, 1), Candidate(None, 0, K, 1)])] == [5, 0]
    assert [d.k for d in ctl.plan(decode(2))] == [0, 0]
    assert not any(d.draft for d in ctl.plan(decode(2)))  # probes now every 4 steps
    assert [d.draft for d in ctl.plan(decode(2))] == [0, K]  # the next probe: in turn
    saved = []
    ctl.on_refined, ctl.refine_save_every = saved.append, 3
    for _ in range(7):
        ctl.observe_step(2, 2, 0, 0.05)
    assert saved == [ctl.cost, ctl.cost]


def test_realized_gain_compares_speculative_with_plain_steps():
    gain = RealizedGain(2, decay=0.9, min_weight=1.5, confidence=0.0, idle_decay=1.0)
    assert gain.correction(0) == 1.0  # no evidence: trust the models
    gain.observe(0, True, 2.0, 1.0, 0.1, 0.1)
    assert gain.correction(0) == 1.0  # one step is not evidence
    gain.observe(0, True, 2.0, 1.0, 0.1, 0.1)
    assert gain.correction(0) == pytest.approx(0.5)  # half the promised tokens
    # plain steps 20% slower than predicted: the same error hits speculative steps, only the
    # relative shortfall counts
    for _ in range(2):
        gain.observe(0, False, 4.0, 4.0, 0.1, 0.125)
    assert gain.correction(0) == pytest.approx(0.5 / 0.8)
    for _ in range(40):  # speculation delivering more than promised is not extrapolated
        gain.observe(0, True, 1.0, 3.0, 0.1, 0.1)
    assert gain.correction(0) == 1.0
    for _ in range(40):
        gain.observe(0, True, 4.0, 1.0, 0.1, 0.2)
    assert gain.correction(0) == gain.floor
    assert gain.correction(1) == 1.0  # buckets are separate


def test_a_few_steps_discount_little_and_the_discount_ages():
    """A discount is read at the top of its error bar: a few scattered steps discount little,
    many discount fully; and plain steps age it, so speculation that stopped on it is tried
    again in time."""
    gain = RealizedGain(1)  # one standard error
    for _ in range(2):
        gain.observe(0, False, 1.0, 1.0, 0.1, 0.1)
    promised = 1.5
    six = [1, 1, 2, 1, 1, 1]  # six unlucky steps: 7 tokens of 9 promised
    for produced in six:
        gain.observe(0, True, promised, produced, 0.1, 0.1)
    assert 0.85 < gain.correction(0) < 0.9  # (0.78 read, 0.10 its standard error)
    for _ in range(40):  # many such steps are evidence
        for produced in six:
            gain.observe(0, True, promised, produced, 0.1, 0.1)
    many = gain.correction(0)
    assert 0.78 < many < 0.83
    for _ in range(300):  # then only plain steps: the evidence ages towards no discount
        gain.observe(0, False, 1.0, 1.0, 0.1, 0.1)
    assert many + 0.04 < gain.correction(0) < 1.0  # (half its weight in 140 plain steps)


def test_speculation_that_does_not_deliver_stops():
    # (no plain probes: the 200 verifying steps below would make the last plan one)
    ctl = controller(acceptance=0.7, per_token=0.002, draft=0.0, plain_probe_interval=10**6)
    assert ctl.plan(decode(1))[0].k == 4  # the models promise about 2x
    predicted = ctl.cost.step_time(1, 5)
    expected = ctl.expected_tokens(None, 4)
    assert expected == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)
    # every verification produces a single token in the predicted time, plain steps are as
    # predicted: speculation lost, whatever the acceptance model still believes
    for _ in range(20):
        ctl.observe_step(1, 5, 0, predicted, verified=4, expected=expected, produced=1)
        ctl.observe_step(1, 1, 0, ctl.cost.step_time(1, 1), expected=1.0, produced=1)
    assert ctl.plan(decode(1))[0].k == 0
    # steps without the token counts (prefill chunks in the batch) only refine the costs
    ctl.observe_step(1, 5, 0, predicted, verified=4)
    # delivering as promised again lifts the discount
    for _ in range(200):
        ctl.observe_step(1, 5, 0, predicted, verified=4, expected=expected, produced=expected)
    assert ctl.plan(decode(1))[0].k == 4


def test_probes_do_not_lift_the_realized_discount():
    """A probe is chosen by turn, not by the models: its steps, priced right, must not wash
    out the evidence that the drafting the models chose delivered less than promised."""
    ctl = controller(acceptance=0.3, per_token=0.002, draft=0.0, probe_interval=3,
                     max_probe_interval=3)
    (d,) = ctl.plan(decode(1))
    assert d.k > 0  # the models promise a gain
    predicted, expected = ctl.cost.step_time(1, 1 + d.k), ctl.expected_tokens(None, d.k)
    for _ in range(20):  # chosen speculation delivers a quarter less than promised
        ctl.plan(decode(1))
        ctl.observe_step(1, 1 + d.k, 1, predicted, verified=d.k, expected=expected,
                         produced=expected * 0.75)
    discount = ctl.realized.correction(0)
    assert discount < 0.8  # (0.75, read a standard error higher)
    chosen = 0
    for _ in range(60):
        probe_verify = ctl._verify_probe
        (d,) = ctl.plan(decode(1))
        chosen += d.k > 0 and not probe_verify
        # every step as its models promised, plain and probe alike
        tokens = 1 + d.k
        drafted = int(d.draft > 0)
        ctl.observe_step(1, tokens, drafted, ctl.cost.step_time(1, tokens)
                         + ctl.cost.draft_time(drafted), verified=d.k,
                         expected=ctl.expected_tokens(None, d.k),
                         produced=ctl.expected_tokens(None, d.k))
    # (plain steps age it a little, probes not at all)
    assert discount <= ctl.realized.correction(0) < discount + 0.03
    assert chosen == 0


def test_fixed_k_mode_and_batch_limit():
    fixed = SpecController(K, AcceptanceModel(K, [0.0] * K), None, SpecDecodingStats(K),
                           adaptive=False)
    assert [(d.k, d.draft) for d in fixed.plan(decode(3, available=5))] == [(5, K)] * 3
    limited = SpecController(K, AcceptanceModel(K), None, SpecDecodingStats(K), adaptive=False,
                             max_batch=2)
    assert all(d.k == 0 and not d.draft for d in limited.plan(decode(3)))
    assert all(d.draft for d in limited.plan(decode(2)))
    with pytest.raises(ValueError, match="cost model"):
        SpecController(K, AcceptanceModel(K), None, SpecDecodingStats(K), adaptive=True)


def test_choice_histogram_and_acceptance_feedback():
    ctl = controller(acceptance=0.5, per_token=0.0, draft=0.0)
    state = ctl.acceptance.new_request()
    ctl.observe(state, 0, 0)
    ctl.observe(state, 3, 2)
    assert ctl.stats.num_steps_by_k[:4] == [1, 0, 0, 1]
    assert ctl.stats.num_drafts == 1 and ctl.stats.num_accepted_tokens == 2


# -- acceptance model ---------------------------------------------------------------------------

def test_acceptance_observations_are_conditional_per_position():
    model = AcceptanceModel(4, [0.5] * 4, seed_weight=1.0, request_weight=1.0,
                            request_decay=1.0, global_decay=1.0)
    state = model.new_request()
    model.observe(state, 4, 1)  # position 1 accepted, 2 rejected, 3 and 4 not observed
    assert state.trials == [1.0, 1.0, 0.0, 0.0]
    assert state.hits == [1.0, 0.0, 0.0, 0.0]
    rates = model.rates(state)
    g = model.global_rates()
    assert g[0] == pytest.approx(0.75) and g[1] == pytest.approx(0.25) and g[2] == 0.5
    assert rates[0] == pytest.approx((1 + g[0]) / 2) and rates[2] == pytest.approx(g[2])
    assert expected_gains([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]


def test_engine_wide_curve_follows_a_change_of_traffic():
    # arithmetic traffic (every draft accepted), then chat (the first draft rejected): within
    # a hundred verifications new requests start from the chat rate, not the arithmetic one
    model = AcceptanceModel(K, [0.5] * K)
    for _ in range(1000):
        model.observe(model.new_request(), K, K)
    assert model.global_rates()[0] > 0.85
    for _ in range(100):
        model.observe(model.new_request(), K, 0)
    assert model.global_rates()[0] < 0.3
    # and one request's own evidence outweighs the engine-wide curve within five verifications
    state = model.new_request()
    for _ in range(5):
        model.observe(state, K, K)
    assert model.rates(state)[0] > 0.6


def test_a_request_drafts_again_after_plain_steps():
    # acceptance comes in runs: rejected blocks stop a request drafting, but its own evidence
    # ages with every plain step, so it tries again within a few steps rather than decoding
    # plainly until a probe reaches it
    ctl = controller(acceptance=0.5, per_token=0.0005, draft=0.006, probe_interval=10**6)
    state = ctl.acceptance.new_request()
    rejected = 0
    while ctl.plan([Candidate(state, K, K, 1)])[0].draft:
        ctl.observe(state, 3, 0)
        rejected += 1
        assert rejected < 8
    before = ctl.acceptance.global_rates()
    plain = 0
    while not ctl.plan([Candidate(state, 0, K, 1)])[0].draft:
        ctl.observe(state, 0, 0)
        plain += 1
        assert plain < 20
    assert 1 <= plain <= 8
    assert ctl.acceptance.global_rates() == before  # plain steps tell nothing engine-wide
    # aged out entirely, the request is back on the engine-wide curve
    for _ in range(100):
        ctl.observe(state, 0, 0)
    assert ctl.acceptance.rates(state) == pytest.approx(ctl.acceptance.global_rates(), abs=1e-3)


def test_a_plan_that_drafts_nobody_stands_while_its_inputs_do():
    """Under load where nothing pays, the batch is priced once per ``replan_interval`` steps at
    first, then ever more rarely (the interval doubles, to ``max_replan_interval``) while the
    batch size stays in its bucket of the cost model's rows and no verification is observed;
    another bucket, new verification evidence, or drafts held are priced at once, and a
    request joining such a batch does not draft either."""
    ctl = controller(acceptance=0.01, per_token=0.001, draft=0.01, probe_interval=10**6,
                     replan_interval=4, max_replan_interval=16)
    priced = []
    inner = ctl._optimal_ks
    ctl._optimal_ks = lambda *a, **kw: (priced.append(len(a[0])), inner(*a, **kw))[1]
    steps = []
    for step in range(1, 60):
        n = 4 if step % 3 else 3  # requests leaving and joining: the same bucket (4 rows)
        before = len(priced)
        assert not any(d.draft or d.k for d in ctl.plan(decode(n, available=0)))
        if len(priced) > before:
            steps.append(step)
    assert steps == [1, 5, 13, 29, 45]  # after 4, 8, 16 and 16 steps
    assert ctl.fresh_request_drafts(4) == 0 and len(priced) == 5  # stands for a joining one
    ctl.plan(decode(16, available=0))  # another bucket: priced at once
    assert priced[-1] == 16
    ctl.plan(decode(16, available=0))
    assert len(priced) == 6
    ctl.observe(ctl.acceptance.new_request(), 2, 1)  # a verification anywhere
    ctl.plan(decode(16, available=0))
    assert len(priced) == 7
    ctl.plan(decode(16, available=2))  # drafts held: the verification is priced
    assert len(priced) == 8
    # a plan that drafts stands never
    busy = controller(acceptance=0.95, per_token=0.0, draft=0.0, replan_interval=4)
    assert all(all(d.draft for d in busy.plan(decode(4, available=0))) for _ in range(6))
    assert busy.fresh_request_drafts(4) > 0


def _serve(ctl: SpecController, truth: StepCostModel, rows: int, acceptance: float,
           steps: int) -> list[tuple[int, int]]:
    """Steps of ``rows`` decoding requests timed by ``truth``, drafts accepted at
    ``acceptance`` a position; (drafts verified, requests drafting) per step."""
    rng = np.random.default_rng(0)
    states = [ctl.acceptance.new_request() for _ in range(rows)]
    held = [K] * rows
    out = []
    for _ in range(steps):
        ds = ctl.plan([Candidate(states[i], held[i], K, 1) for i in range(rows)])
        expected = sum(ctl.expected_tokens(states[i], d.k) for i, d in enumerate(ds))
        produced = 0
        for state, d in zip(states, ds):
            n = 0
            while n < d.k and rng.random() < acceptance:
                n += 1
            produced += 1 + n
            ctl.observe(state, d.k, n)
        verified, drafting = sum(d.k for d in ds), sum(d.draft > 0 for d in ds)
        draft = truth.draft_time(drafting)
        ctl.observe_step(rows, rows + verified, drafting,
                         truth.step_time(rows, rows + verified) + draft, verified=verified,
                         expected=expected, produced=produced, draft_seconds=draft)
        held = [d.draft for d in ds]
        out.append((verified, drafting))
    return out


def test_plain_probes_measure_a_level_that_only_verifying_steps_would_leave_stale():
    """A cost line raised by a slow spell (here 1.6x) made drafting look worth it; where every
    step then verifies, no plain step measures the level again. Plain probes do, and the
    drafting stops; where drafting truly pays, they become rare."""
    truth = cost_model(per_token=0.006, draft=0.005)

    def stale(**kw) -> SpecController:
        believed = cost_model(per_token=0.006, draft=0.005)
        believed.table = [[1.6 * v for v in line] for line in believed.table]
        return SpecController(K, AcceptanceModel(K, [0.5] * K), believed, SpecDecodingStats(K),
                              **kw)

    never = stale(plain_probe_interval=10**9)
    never.realized.min_weight = 10**9  # nor plain steps the realized-gain check asks for
    assert all(v for v, _ in _serve(never, truth, 4, 0.5, 600)[-150:])  # drafts for good
    ctl = stale()
    late = _serve(ctl, truth, 4, 0.5, 600)[-150:]
    assert sum(1 for v, _ in late if v) <= 2  # the probes of drafting only
    assert ctl.cost.step_time(4, 4) == pytest.approx(truth.step_time(4, 4), rel=0.03)
    # one stream where verification is cheap: drafting every step; plain probes back off
    fast = controller(acceptance=0.8, per_token=0.0005, draft=0.002)
    steps = _serve(fast, fast.cost, 1, 0.8, 1500)
    plain = [i for i, (v, _) in enumerate(steps) if not v]
    # the realized-gain check's plain steps once its first verifying ones are in, then
    # periodic probes from 32 steps on, ever rarer
    asked = [i for i in plain if i < 32]
    assert 4 <= len(asked) <= 6 and asked[0] >= 4
    assert len(plain) - len(asked) <= 6
    assert fast._plain_every[0] == 512


def test_seed_curve_file(tmp_path, caplog):
    assert load_seed_curve(tmp_path) is None
    (tmp_path / "acceptance.json").write_text(json.dumps({"conditional": [0.6, 0.4]}))
    assert load_seed_curve(tmp_path) == [0.6, 0.4]
    assert AcceptanceModel(4, [0.6, 0.4]).seed == [0.6, 0.4, 0.4, 0.4]
    (tmp_path / "acceptance.json").write_text('{"conditional": [1.5]')
    with caplog.at_level("WARNING"):
        assert load_seed_curve(tmp_path) is None
    assert "ignoring" in caplog.text


# -- cost model ----------------------------------------------------------------------------------

def test_cost_interpolation_and_extrapolation():
    m = cost_model(per_token=0.01, draft=0.005)
    assert m.step_time(1, 1) == pytest.approx(0.02)
    assert m.step_time(4, 8) == pytest.approx(0.08 + 0.04)  # 2 tokens per row
    assert m.step_time(2, 2) == pytest.approx(0.02 + 0.06 / 3)  # a third of the way to 4 rows
    assert m.step_time(128, 128) == pytest.approx(m.step_time(64, 64) * 2)
    assert m.step_time(1, 16) == pytest.approx(0.02 + 0.15)  # past 8 per row: last slope
    assert m.draft_time(0) == 0 and m.draft_time(2) == pytest.approx(0.01)


def test_one_step_reading_equals_the_vectorised_one():
    """``step_time``/``draft_time`` (pure Python, run every step) read exactly what
    ``step_times``/``draft_times`` (the controller's pricing) read: between and past lines,
    below a line's plain step, past the last cell, in order and as written."""
    rng = np.random.default_rng(0)
    m = cost_model(per_token=0.001, draft=0.004)
    m.table = [[v * rng.uniform(0.8, 1.2) for v in line] for line in m.table]  # out of order
    tokens = np.arange(0, 700)
    for rows in (0, 1, 2, 3, 4, 9, 16, 40, 64, 100, 200):
        for ordered in (True, False):
            many = m.step_times(rows, tokens, ordered=ordered)
            one = [m.step_time(rows, int(t), ordered=ordered) for t in tokens]
            assert one == pytest.approx(many.tolist(), rel=1e-12, abs=1e-15)
    assert [m.draft_time(r) for r in range(-1, 150)] == pytest.approx(
        m.draft_times(np.arange(-1, 150)).tolist(), rel=1e-12, abs=1e-15)
    m.draft_slot = [0.0004, 0.0002, 0.0003, 0.0001]  # priced slots: one reading, too
    pairs = [(r, s) for r in range(-1, 150, 3) for s in range(0, 8 * max(1, r), max(1, r))]
    rows, slots = (np.asarray(v) for v in zip(*pairs))
    assert [m.draft_time(r, s) for r, s in pairs] == pytest.approx(
        m.draft_times(rows, slots).tolist(), rel=1e-12, abs=1e-15)
    assert m.draft_time(4, 4) == m.draft_time(4) and m.draft_time(4, 2) == m.draft_time(4)
    assert m.draft_time(4, 10) == pytest.approx(m.draft_time(4) + 6 * 0.0002)
    single = StepCostModel([4], [4, 8], [[0.02, 0.03]], [0.001], max_per_row=2)
    assert single.step_time(4, 12) == pytest.approx(float(single.step_times(4, [12])[0]))
    assert single.draft_time(8) == pytest.approx(0.002)


def test_cost_online_refinement_moves_toward_measurements():
    m = cost_model(per_token=0.0, draft=0.0)
    for _ in range(100):
        m.observe(1, 8, 0, 0.04)  # verifying 8 tokens really costs twice a decode
    assert m.step_time(1, 8) == pytest.approx(0.04, rel=0.02)
    for _ in range(100):
        m.observe(1, 1, 1, 0.03, draft_seconds=0.01)  # a decode step with a 10 ms draft pass
    assert m.draft_time(1) == pytest.approx(0.01, rel=0.05)
    before = m.step_time(1, 1)
    m.observe(1, 500, 0, 5.0)  # a prefill-sized step is outside the grid: ignored
    assert m.step_time(1, 1) == before
    # a few drafts verified in a 16-row step (q = 1.25) cost far more than predicted: the
    # verification columns absorb it, the plain-decode baseline stays what plain steps measure
    plain, two = m.step_time(16, 16), m.step_time(16, 32)
    for _ in range(50):
        m.observe(16, 20, 0, 2 * m.step_time(16, 20))
    assert m.step_time(16, 16) == plain and m.step_time(16, 32) > 1.5 * two


def test_cost_lines_are_read_in_order():
    """Verifying steps that ran cheaper than the plain decode beside them (shorter contexts, a
    quieter moment) lower their own cells, but a step with drafts is never priced below the
    plain step; the cells keep what was measured (ordering them where they are written let
    noise ratchet the larger blocks upward)."""
    m = cost_model(per_token=0.001, draft=0.0)  # one-row line 20 / 21 / 23 / 27 ms
    plain = m.step_time(1, 1)
    for _ in range(100):
        m.observe(1, 2, 0, 0.8 * plain)
    assert m.table[0][1] == pytest.approx(0.8 * plain, rel=0.02)  # what was measured
    assert m.step_time(1, 2) == pytest.approx(plain)  # read: at least the plain step
    assert m.step_time(1, 3) >= m.step_time(1, 2) and m.step_time(1, 1) == pytest.approx(plain)
    times = m.step_times(1, np.arange(1, 40))
    assert (np.diff(times) >= 0).all()


def test_a_block_measured_cheaper_bounds_the_smaller_blocks():
    """Stale, high cells left of a verified block set its ordered price for good (the 8-token
    cell priced a 16-token step at 44 ms for 60 steps that took 26); a cheaper measurement of
    a block now pulls the smaller blocks' cells down to it, never the plain cell, and never
    raises anything."""
    m = cost_model(per_token=0.0005, draft=0.0)  # one-row line 20 / 20.5 / 21.5 / 23.5 ms
    line = m.table[0]
    plain = line[0]
    for j in (1, 2):  # 2 and 4 tokens: 1.6x, stale since a slow spell
        line[j] *= 1.6
    assert m.step_time(1, 8) == pytest.approx(1.6 * (plain + 0.0015))  # the 4-token cell's
    for _ in range(40):
        m.observe(1, 8, 0, 0.0235)  # what 8 tokens take
    assert m.step_time(1, 8) == pytest.approx(0.0235, rel=0.02)
    assert all(m.table[0][j] <= m.table[0][3] + 1e-12 for j in (1, 2))
    assert m.table[0][0] == plain  # verifying steps never move the plain cell
    # a dearer measurement raises only its own cell
    before = list(m.table[0])
    m.observe(1, 4, 0, 0.05)
    assert m.table[0][2] > before[2] and m.table[0][:2] == before[:2]
    assert m.table[0][3:] == before[3:]


def test_probes_unfreeze_verification_prices_left_stale():
    """One stream whose verification cells stand 2x above the truth (a slow spell while it
    verified, then plain steps scaling the line back) never verifies at those prices, so no
    step of its own corrects them. The probes' whole blocks, weighted as deliberate
    measurements, bound the smaller blocks, and drafting resumes."""
    truth = cost_model(per_token=0.0005, draft=0.002)
    believed = cost_model(per_token=0.0005, draft=0.002)
    for line, rows in zip(believed.table, believed.rows):
        for j, t in enumerate(believed.tokens):
            if t > rows:
                line[j] *= 2.0
    ctl = SpecController(K, AcceptanceModel(K, [0.5] * K), believed, SpecDecodingStats(K))
    assert not any(d.draft for d in ctl.plan(decode(1, available=0)))  # stale: no drafting
    steps = _serve(ctl, truth, 1, 0.5, 600)
    assert sum(1 for v, _ in steps[-200:] if v) >= 180  # verifying almost every step again


def test_cost_refinement_with_the_draft_timed_apart():
    """One stream drafting every step visits only verify-and-draft steps. With the proposer's
    time known, the draft curve and the table each learn their own part (from the step's total
    alone, as before, a one-row line 20% too high priced the draft pass at nothing)."""
    m = cost_model(per_token=0.002, draft=0.007, base=0.08)  # the table says 80 ms; it is 68
    for _ in range(200):
        m.observe(1, 2, 1, 0.068 + 0.007, draft_seconds=0.007)
    assert m.draft_time(1) == pytest.approx(0.007, rel=0.01)
    assert m.table[0][1] == pytest.approx(0.068, rel=0.02)  # (read no lower than plain's 80)
    # a drafting plain decode (no drafts verified) is a plain step plus the draft pass
    for _ in range(200):
        m.observe(1, 1, 1, 0.060 + 0.010, draft_seconds=0.010)
    assert m.step_time(1, 1) == pytest.approx(0.060, rel=0.02)
    assert m.draft_time(1) == pytest.approx(0.010, rel=0.01)


def test_draft_slots_are_priced_and_the_pass_refined_without_them():
    """A request runs only the draft slots its drafts need, each priced by the cost model:
    where a slot costs more than the deeper drafts promise, requests draft fewer (but still
    draft); a drafting step's time less its slots' price refines the pass itself."""
    cheap = controller(acceptance=0.9, per_token=0.0005, draft=0.002)
    assert [d.draft for d in cheap.plan(decode(1))] == [K]
    costly = controller(acceptance=0.9, per_token=0.0005, draft=0.002)
    costly.cost.draft_slot = [0.004] * 4
    (d,) = costly.plan(decode(1))
    assert 0 < d.draft < K
    # a tree's drafts occupy the slots of their depths: the first five nodes here, three
    tree = DraftTree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0], [2]])
    assert slots_needed(tree, 6) == (0, 1, 1, 2, 2, 3, 3) and slots_needed(None, 3) == (0, 1, 2, 3)
    # ordered per block, the first n nodes may be a chain: n slots, up to the tree's depth
    dynamic = dataclasses.replace(tree, dynamic=True)
    assert slots_needed(dynamic, 6) == (0, 1, 2, 3, 3, 3, 3)
    m = cost_model(per_token=0.002, draft=0.009)
    m.draft_slot = [0.001] * 4
    for _ in range(200):  # one request drafting 4 slots: a 7 ms pass and 3 ms of slots
        m.observe(1, 2, 1, 0.02 + 0.002 + 0.010, draft_seconds=0.010, drafted_slots=4)
    assert m.draft_time(1) == pytest.approx(0.007, rel=0.01)
    assert m.draft_time(1, 4) == pytest.approx(0.010, rel=0.01)


def test_cost_refinement_between_ladder_rows_moves_both_neighbours():
    m = cost_model(per_token=0.0, draft=0.0)  # rows 1, 4, 16, 64
    target = 1.2 * m.step_time(32, 32)
    below, above = m.step_time(16, 16), m.step_time(64, 64)
    for _ in range(300):
        m.observe(32, 32, 0, target)
    assert m.step_time(32, 32) == pytest.approx(target, rel=0.02)
    # 32 rows lie a third of the way from 16 to 64: both cells share the correction, the
    # nearer one moving more (only the nearest moved before, and a mis-fit there stayed)
    assert m.step_time(16, 16) > below and m.step_time(64, 64) > above
    assert m.step_time(16, 16) / below > m.step_time(64, 64) / above


def test_cost_json_round_trip_and_validation():
    m = cost_model(0.01, 0.0)
    assert StepCostModel.from_json(json.loads(json.dumps(m.to_json()))).table == m.table
    bad = m.to_json() | {"table": m.table[:-1]}
    with pytest.raises(ValueError):
        StepCostModel.from_json(bad)


def test_cost_interpolation_on_an_uneven_table():
    import numpy as np

    # lines start at their plain step (below it: that step's time)
    m = StepCostModel([1, 4, 16], [1, 2, 4, 8, 16, 32],
                      [[0.02, 0.021, 0.025, 0.04, 0.05, 0.07],
                       [0.03, 0.03, 0.03, 0.035, 0.05, 0.08],
                       [0.06, 0.06, 0.06, 0.06, 0.06, 0.08]], [0.004, 0.006, 0.01], 8)
    assert m.step_times(1, np.array([1, 3, 8, 40])) == pytest.approx(
        [0.02, 0.023, 0.04, 0.07 + 8 * 0.02 / 16])  # past 32 tokens: the last slope
    # 2 rows: a third of the way from the 1-row line to the 4-row line, at the same tokens;
    # never below 2 tokens (each row runs one)
    assert m.step_times(2, np.array([1, 2, 8])) == pytest.approx(
        [0.021 + 0.009 / 3, 0.021 + 0.009 / 3, 0.04 - 0.005 / 3])
    # past the last line: its time at the same tokens per row, scaled by the rows
    assert m.step_times(32, np.array([32, 64])) == pytest.approx([0.12, 0.16])
    # past a line ending on a tile's edge (16 | 17 tokens: +3 ms) the slope spans whole tiles
    edge = StepCostModel([1], [1, 16, 17], [[0.02, 0.023, 0.026]], [0.0], 33)
    assert edge.step_time(1, 33) == pytest.approx(0.026 + 16 * 0.006 / 16)
    assert m.draft_times(np.array([0, 1, 2, 16, 32])) == pytest.approx(
        [0.0, 0.004, 0.004 + 0.002 / 3, 0.01, 0.02])


def test_config_keys_of_the_policy():
    from engine.config import ConfigError, SpeculativeConfig

    assert SpeculativeConfig.parse({"method": "ngram"}).adaptive is True
    assert SpeculativeConfig.parse('{"method": "ngram", "adaptive": false}').adaptive is False
    with pytest.raises(ConfigError, match="true or false") as err:
        SpeculativeConfig.parse({"method": "ngram", "adaptive": "yes"})
    assert err.value.param == "speculative_config.adaptive"
    with pytest.raises(ConfigError, match="replaced by the adaptive controller") as err:
        SpeculativeConfig.parse({"method": "ngram", "min_acceptance_length": 1.5})
    assert err.value.param == "speculative_config.min_acceptance_length"


def test_a_gain_within_the_models_error_is_not_taken():
    # free verification, no draft cost, 3% acceptance: +3% expected, under a 5% margin; 2%
    # is under the default 3%, 4% over it
    assert all(d.k == 0 for d in controller(0.03, 0.0, 0.0, min_gain=1.05).plan(decode(2)))
    assert all(d.k == 0 for d in controller(0.02, 0.0, 0.0).plan(decode(2)))
    assert all(d.k > 0 for d in controller(0.04, 0.0, 0.0).plan(decode(2)))
    assert all(d.k > 0 for d in controller(0.02, 0.0, 0.0, min_gain=1.0).plan(decode(2)))


def test_probes_remeasure_small_blocks_a_calibration_over_priced():
    """One stream whose startup calibration priced its 2- and 4-token blocks 45% high (a slow
    moment at startup; large blocks priced right): one draft pays (+11% a step for 0.48 tokens
    more), but at that price nothing does, and probes that verify whole blocks only measure the
    large ones, which are right. Every other probe verifies a single draft, so the smallest
    block is measured too, and drafting starts."""
    truth = cost_model(per_token=0.0016, draft=0.0022, base=0.014)
    believed = cost_model(per_token=0.0016, draft=0.0022, base=0.014)
    for j, t in enumerate(believed.tokens):
        if t in (2, 4):
            believed.table[0][j] *= 1.45
    ctl = SpecController(K, AcceptanceModel(K, [0.48] * K), believed, SpecDecodingStats(K))
    assert not any(d.draft for d in ctl.plan(decode(1, available=0)))  # over-priced: none
    steps = _serve(ctl, truth, 1, 0.48, 1500)
    # the one-draft block re-measured (it stayed 45% high with whole-block probes only)
    assert ctl.cost.step_time(1, 2) == pytest.approx(truth.step_time(1, 2), rel=0.05)
    # and drafting done: 241 verifying steps here, 11 (the probes) without; 787 for a model
    # priced right from the start (one request whose own acceptance estimate, at 0.48, now and
    # then falls below what pays and waits for a probe)
    assert sum(1 for v, _ in steps if v) >= 150


def test_plain_probes_that_draft_feed_the_realized_gain_check():
    """A 16-row line priced as 16 one-row steps (a calibration that timed one row only) puts 16
    more tokens at +4% of a plain step where they cost +39%: drafting looks worth it, every
    step verifies, and the only plain steps are the probes, which draft as planned. Counted as
    plain evidence (their draft pass left out), they show speculative steps delivering less
    than plain ones, and verification stops."""
    rows, tokens = [1, 4, 16, 64], [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

    def model(price) -> StepCostModel:
        return StepCostModel(rows, tokens, [[price(r, max(t, r)) for t in tokens] for r in rows],
                             [0.001 * r for r in rows], max_per_row=8)

    truth = model(lambda r, t: 0.015 + 0.0006 * t)  # the products: a step's tokens in all
    believed = model(lambda r, t: r * (0.015 + 0.0006 * t / r))
    ctl = SpecController(K, AcceptanceModel(K, [0.3] * K), believed, SpecDecodingStats(K))
    # (counted as speculative, the probes left the check blind: 145 of the first 150 steps
    # verified, until verifying steps had refined their own prices up)
    first = _serve(ctl, truth, 16, 0.3, 150)
    assert sum(1 for v, _ in first if v) <= 15
