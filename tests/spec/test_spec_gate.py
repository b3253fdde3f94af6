"""The acceptance gate pauses drafting for a request whose drafts keep failing, backs off
between probes, never pauses a request whose drafts are accepted, and never changes output."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, SpeculativeConfig
from engine.spec.gate import AcceptanceGate, GateState

from .helpers import (
    TARGET_VOCAB,
    OracleProposer,
    assert_same_tokens,
    expected_full_acceptance,
    greedy,
    make_llm,
    random_prompts,
    token_ids,
)

PROMPTS = random_prompts([6, 13], seed=41)
LONG = 64


def _paused_steps(gate, state, n):
    return sum(not gate.allows(state) for _ in range(n))


def test_failed_drafts_pause_with_doubling_backoff():
    gate = AcceptanceGate(1.5, smoothing=0.5, first_pause=4, max_pause=16)
    s = GateState()
    gate.observe(s, 0)  # acceptance length 1 < 1.5
    assert (s.mean_acceptance, s.pause) == (1.0, 4)
    assert _paused_steps(gate, s, 4) == 4 and gate.allows(s)
    pauses = []
    for _ in range(4):  # every probe fails again: 8, 16, then capped at 16
        gate.observe(s, 0)
        pauses.append(s.pause)
        _paused_steps(gate, s, s.pause)
    assert pauses == [8, 16, 16, 16]


def test_a_good_probe_resumes_and_resets_the_backoff():
    gate = AcceptanceGate(1.5, smoothing=0.5)
    s = GateState()
    gate.observe(s, 0)
    gate.observe(s, 0)
    assert s.backoff == 8
    gate.observe(s, 3)  # mean 0.5 * 4 + 0.5 * 1 = 2.5
    assert s.mean_acceptance == pytest.approx(2.5) and s.pause == 0 and s.backoff == 0
    assert gate.allows(s)


def test_good_drafts_never_pause():
    gate = AcceptanceGate(2.0)
    s = GateState()
    for accepted in [3, 1, 2, 4, 1, 2]:
        gate.observe(s, accepted)
        assert s.pause == 0 and gate.allows(s)


@pytest.mark.parametrize("bad", [1.0, 0.5, -3, True, "2", float("inf"), float("nan")])
def test_min_acceptance_length_is_validated(bad):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse({"method": "ngram", "min_acceptance_length": bad})
    assert err.value.param == "speculative_config.min_acceptance_length"


@pytest.fixture(scope="module")
def futures(qwen3_target, baseline_cache):
    outs = baseline_cache(qwen3_target, PROMPTS, [LONG] * len(PROMPTS), "auto")
    return {tuple(p): o for p, o in zip(PROMPTS, outs)}


def _gated_oracle(model, futures, k, corrupt=None, floor=1.5):
    spec = {"method": "ngram", "num_speculative_tokens": k, "min_acceptance_length": floor}
    llm = make_llm(model, spec)
    oracle = OracleProposer(futures, k, TARGET_VOCAB, corrupt)
    llm.engine.runner.proposer = oracle
    return llm


def test_accepted_drafts_are_never_gated(qwen3_target, futures):
    k, max_tokens = 3, [40, 29]
    llm = _gated_oracle(qwen3_target, futures, k, floor=3.5)
    outs = token_ids(llm.generate(PROMPTS, [greedy(m) for m in max_tokens]))
    assert_same_tokens(outs, [futures[tuple(p)][:m] for p, m in zip(PROMPTS, max_tokens)])
    want = [expected_full_acceptance(m, k) for m in max_tokens]
    assert llm.get_spec_decoding_stats().num_drafts == sum(w[0] for w in want)


def test_failing_drafts_are_gated_and_output_is_unchanged(qwen3_target, futures):
    """Every draft is wrong at its first position, so each step yields one token: without the
    gate each of the 63 steps after the first token drafts; with it, steps 1, 6, 15 and 32 do
    (pauses of 4, 8 and 16 steps after each failure) and the pause of 32 outlasts the output."""
    llm = _gated_oracle(qwen3_target, futures, 3, corrupt=lambda call, rid: 0)
    out = token_ids(llm.generate([PROMPTS[0]], [greedy(LONG)]))
    assert_same_tokens(out, [futures[tuple(PROMPTS[0])][:LONG]])
    stats = llm.get_spec_decoding_stats()
    assert stats.num_accepted_tokens == 0
    assert stats.num_drafts == 4
