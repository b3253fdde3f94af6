"""An oracle proposer (the target's own greedy future) gets every draft accepted; a stop id or
max_tokens that lands inside an accepted block truncates the output exactly there."""

from __future__ import annotations

import pytest

from engine import SamplingParams

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

PROMPTS = random_prompts([5, 16, 9], seed=31)
LONG = 48  # the oracle knows this many future tokens per prompt


@pytest.fixture(scope="module")
def futures(qwen3_target, baseline_cache):
    outs = baseline_cache(qwen3_target, PROMPTS, [LONG] * len(PROMPTS), "auto")
    return {tuple(p): o for p, o in zip(PROMPTS, outs)}


def _oracle_llm(model, futures, k, corrupt=None, **kwargs):
    llm = make_llm(model, {"method": "ngram", "num_speculative_tokens": k}, **kwargs)
    oracle = OracleProposer(futures, k, TARGET_VOCAB, corrupt)
    llm.engine.runner.proposer = oracle
    return llm, oracle


@pytest.mark.parametrize("k", [1, 3, 6])
def test_oracle_accepts_everything(qwen3_target, futures, k):
    max_tokens = [30, 23, 17]
    llm, _ = _oracle_llm(qwen3_target, futures, k)
    outs = token_ids(llm.generate(PROMPTS, [greedy(m) for m in max_tokens]))
    assert_same_tokens(outs, [futures[tuple(p)][:m] for p, m in zip(PROMPTS, max_tokens)])
    stats = llm.get_spec_decoding_stats()
    want = [expected_full_acceptance(m, k) for m in max_tokens]
    drafts = sum(w[0] for w in want)
    accepted = sum(w[1] for w in want)
    per_pos = [sum(w[2][j] for w in want) for j in range(k)]
    assert stats.num_drafts == drafts
    assert stats.num_draft_tokens == accepted  # every verified draft token was accepted
    assert stats.num_accepted_tokens == accepted
    assert stats.num_accepted_tokens_per_pos == per_pos
    assert stats.mean_acceptance_length == pytest.approx(1 + accepted / drafts)


def test_expected_full_acceptance_arithmetic():
    # 20 tokens, K=3: outputs 1 -> 5 -> 9 -> 13 -> 17 -> (trim to 2) 20
    assert expected_full_acceptance(20, 3) == (5, 14, [5, 5, 4])
    assert expected_full_acceptance(2, 3) == (0, 0, [0, 0, 0])
    assert expected_full_acceptance(3, 3) == (1, 1, [1, 0, 0])
    # 30 tokens, K=3: 1 from prefill, 7 blocks of 3 drafts + bonus, then a plain decode
    assert expected_full_acceptance(30, 3) == (7, 21, [7, 7, 7])


@pytest.mark.parametrize("k", [2, 4])
def test_oracle_with_rejections_at_every_position(qwen3_target, baseline_cache, k):
    """Drafts wrong at position (call % (K+1)) (K+1 meaning none wrong): acceptance lengths
    cycle through 0..K, so target K/V at rejected positions must be rolled back and overwritten."""

    def corrupt(call, rid):
        j = call % (k + 1)
        return j if j < k else None

    max_tokens = [40, 33, 27]
    # fp8 target cache: the oracle and the expected output come from an fp8 no-spec run
    full = baseline_cache(qwen3_target, PROMPTS, [LONG] * len(PROMPTS), "fp8")
    want = [f[:m] for f, m in zip(full, max_tokens)]
    futures = {tuple(p): f for p, f in zip(PROMPTS, full)}
    llm, _oracle = _oracle_llm(qwen3_target, futures, k, corrupt, kv_cache_layout="HND",
                              kv_cache_dtype="fp8")
    got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in max_tokens]))
    assert_same_tokens(got, want)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert all(per_pos[j] > 0 for j in range(k)), per_pos


def test_stop_token_inside_accepted_block(qwen3_target, futures):
    k = 4
    llm, _ = _oracle_llm(qwen3_target, futures, k)
    prompt = PROMPTS[0]
    full = futures[tuple(prompt)]
    # verify windows emit output indices 1..5, 6..10, ...: pick stops strictly inside a block,
    # at its last accepted draft and at the bonus token
    tested = 0
    for j in range(1, 30):
        tok = full[j]
        if tok in full[:j]:
            continue  # the first occurrence is what must stop the output
        out = llm.generate([prompt], greedy(40, stop_token_ids=[tok]))[0].outputs[0]
        assert list(out.token_ids) == full[: j + 1], f"stop id {tok} at output index {j}"
        assert out.finish_reason == "stop" and out.stop_reason == tok
        tested += 1
    assert tested >= 8


def test_stop_token_never_emitted_past(qwen3_target, futures):
    """Several stop ids: the output ends at whichever occurs first, and contains no stop id
    before its last token."""
    k = 5
    llm, _ = _oracle_llm(qwen3_target, futures, k)
    outs = llm.generate(PROMPTS, [greedy(LONG, stop_token_ids=[f[13], f[7]])
                                  for f in (futures[tuple(p)] for p in PROMPTS)])
    for p, o in zip(PROMPTS, outs):
        full = futures[tuple(p)]
        stops = {full[13], full[7]}
        first = min(i for i, t in enumerate(full) if t in stops)
        got = list(o.outputs[0].token_ids)
        assert got == full[: first + 1]
        assert not stops & set(got[:-1])


@pytest.mark.parametrize("k", [3, 5])
def test_max_tokens_inside_accepted_block(qwen3_target, futures, k):
    llm, _ = _oracle_llm(qwen3_target, futures, k)
    prompt = PROMPTS[1]
    full = futures[tuple(prompt)]
    for m in range(1, 2 * k + 4):
        before = llm.get_spec_decoding_stats().num_draft_tokens
        out = llm.generate([prompt], greedy(m))[0].outputs[0]
        assert list(out.token_ids) == full[:m], f"max_tokens={m}"
        assert out.finish_reason == "length"
        # the scheduler never verifies drafts that could only land past max_tokens
        assert llm.get_spec_decoding_stats().num_draft_tokens - before == \
            expected_full_acceptance(m, k)[1]


def test_eos_inside_accepted_block(qwen3_target, futures, tmp_path):
    """With ignore_eos=False, the model's EOS inside an accepted block ends the output there."""
    import json
    import shutil

    prompt = PROMPTS[2]
    full = futures[tuple(prompt)]
    j = next(j for j in range(2, 30) if full[j] not in full[:j] and j % 4 not in (0, 1))
    folder = tmp_path / "eos-model"
    shutil.copytree(qwen3_target, folder)
    gen = folder / "generation_config.json"
    data = json.loads(gen.read_text()) if gen.exists() else {}
    data["eos_token_id"] = full[j]
    gen.write_text(json.dumps(data))
    llm = make_llm(folder, {"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.runner.proposer = OracleProposer(futures, 3, TARGET_VOCAB)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    assert list(out.token_ids) == full[: j + 1]
    assert out.finish_reason == "stop"



def test_penalties_min_tokens_and_logprobs_with_full_acceptance(qwen3_target):
    """Greedy with repetition/frequency penalties, min_tokens and logprobs goes through the
    per-row sampler: row k must see the history extended by drafts 1..k. With the true
    continuation as drafts, everything is accepted and tokens and logprobs match no-spec."""
    k = 4
    prompts = PROMPTS[:2]
    stop = 17

    def params(m):
        return SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                              repetition_penalty=1.4, frequency_penalty=0.6,
                              min_tokens=12, stop_token_ids=[stop], logprobs=2)

    base = make_llm(qwen3_target, None)
    full = base.generate(prompts, params(LONG))
    futures = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, full)}
    want = base.generate(prompts, params(29))
    llm, _ = _oracle_llm(qwen3_target, futures, k)
    got = llm.generate(prompts, params(29))
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert list(g.token_ids) == list(w.token_ids)
        assert g.finish_reason == w.finish_reason
        assert [lp.token_id for lp in g.logprobs] == list(g.token_ids)
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top.keys() == b.top.keys()
    stats = llm.get_spec_decoding_stats()
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
