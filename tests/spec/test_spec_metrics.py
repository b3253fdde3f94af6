"""SpecDecodingStats after a run: counts, per-position counts and mean acceptance length."""

from __future__ import annotations

import itertools

import pytest

from engine.spec.stats import SpecDecodingStats

from .helpers import (
    TARGET_VOCAB,
    OracleProposer,
    assert_same_tokens,
    greedy,
    make_llm,
    random_prompts,
    token_ids,
)

PROMPTS = random_prompts([3, 14, 8, 22], seed=41)
MAX_TOKENS = [40, 25, 31, 17]


def _check_invariants(stats: SpecDecodingStats, k: int) -> None:
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == k == stats.num_spec_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    assert per_pos[0] <= stats.num_drafts
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_drafts
    assert stats.num_drafts <= stats.num_draft_tokens
    assert stats.mean_acceptance_length == pytest.approx(
        1 + stats.num_accepted_tokens / stats.num_drafts)
    assert stats.acceptance_rate_per_pos == pytest.approx([c / stats.num_drafts for c in per_pos])


def _simulate_cycling(max_tokens: int, k: int):
    """Expected stats for one request whose proposal number c is wrong at position c % (K+1)
    (none wrong when that is K), with drafts trimmed to max_tokens - outputs - 1."""
    out, call, drafts, draft_tokens, accepted, per_pos = 1, 0, 0, 0, 0, [0] * k
    while out < max_tokens:
        s = min(k, max_tokens - out - 1)
        j = call % (k + 1)
        acc = 0
        if s > 0:
            acc = min(j, s) if j < k else s
            drafts += 1
            draft_tokens += s
            accepted += acc
            for p in range(acc):
                per_pos[p] += 1
        out += acc + 1
        call += 1
    return drafts, draft_tokens, accepted, per_pos


@pytest.mark.parametrize("k,max_tokens", [(3, 40), (5, 37)])
def test_stats_exact_with_scripted_acceptance(qwen3_target, baseline_cache, k, max_tokens):
    prompt = PROMPTS[0]
    full = baseline_cache(qwen3_target, [prompt], [max_tokens + k], "auto")[0]
    llm = make_llm(qwen3_target, {"method": "ngram", "num_speculative_tokens": k})

    def corrupt(call, rid):
        j = call % (k + 1)
        return j if j < k else None

    llm.engine.runner.proposer = OracleProposer({tuple(prompt): full}, k, TARGET_VOCAB, corrupt)
    got = token_ids(llm.generate([prompt], greedy(max_tokens)))
    assert_same_tokens(got, [full[:max_tokens]])
    stats = llm.get_spec_decoding_stats()
    drafts, draft_tokens, accepted, per_pos = _simulate_cycling(max_tokens, k)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_accepted_tokens_per_pos) == (drafts, draft_tokens, accepted, per_pos)
    _check_invariants(stats, k)
    assert stats.mean_acceptance_length == pytest.approx(1 + accepted / drafts)


def test_stats_random_dflash_draft(qwen3_target, draft_dir, baseline_cache):
    k = 3
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                                  "num_speculative_tokens": k})
    engine = llm.engine
    engine.add_requests([(str(i), p, greedy(m), None)
                         for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))])
    sampling_steps = 0  # (request, step) pairs that appended tokens, counted independently
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            sampling_steps += out.num_new_tokens > 0
            if out.finished:
                final[int(out.request_id)] = list(out.outputs[0].token_ids)
    got = [final[i] for i in range(len(PROMPTS))]
    assert_same_tokens(got, baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto"))
    stats = llm.get_spec_decoding_stats()
    _check_invariants(stats, k)
    # a random draft over a 256-token vocabulary is (almost) never right
    assert 1.0 <= stats.mean_acceptance_length < 1.3
    # each sampling step is a prefill's first token, a verify ((accepted + 1) tokens) or a
    # plain decode (1 token): the stats must account for every generated token
    plain = sampling_steps - len(PROMPTS) - stats.num_drafts
    assert plain >= 0
    assert len(PROMPTS) + plain + stats.num_drafts + stats.num_accepted_tokens == \
        sum(MAX_TOKENS)
    assert stats.num_drafts > 0


def test_stats_ngram_repetitive_prompt(qwen3_target, baseline_cache):
    """Prompt lookup on a prompt that the model continues by copying: stats stay consistent."""
    k = 4
    prompt = random_prompts([6], seed=5)[0] * 5
    want = baseline_cache(qwen3_target, [prompt], [30], "auto")
    llm = make_llm(qwen3_target, {"method": "ngram", "num_speculative_tokens": k,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert_same_tokens(token_ids(llm.generate([prompt], greedy(30))), want)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_drafts > 0
    _check_invariants(stats, k)


def test_stats_accumulate_across_generate_calls(qwen3_target, draft_dir):
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                                  "num_speculative_tokens": 2})
    llm.generate([PROMPTS[0]], greedy(10))
    first = llm.get_spec_decoding_stats().num_drafts
    llm.generate([PROMPTS[0]], greedy(10))
    assert llm.get_spec_decoding_stats().num_drafts == 2 * first > 0


def test_stats_observe():
    a = SpecDecodingStats(3)
    assert a.mean_acceptance_length == 1.0 and a.num_accepted_tokens_per_pos == [0, 0, 0]
    a.observe(3, 2)
    a.observe(1, 1)
    a.observe(3, 0)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (3, 7, 3)
    assert a.num_accepted_tokens_per_pos == [2, 1, 0]
    a.observe(3, 3)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (4, 10, 6)
    assert a.num_accepted_tokens_per_pos == [3, 2, 1]
    assert a.mean_acceptance_length == pytest.approx(1 + 6 / 4)


def test_disable_by_batch_size_pauses_drafts_but_keeps_output(tmp_path):
    """Above the limit no drafts are verified; output is unchanged either way."""
    from engine import LLM, SamplingParams
    from .helpers import save_draft, save_target

    target = save_target(tmp_path / "t")
    draft = tmp_path / "d"
    save_draft(draft)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = LLM(model=str(target), dtype="float32", speculative_config=None,
               kv_cache_memory="16MiB").generate(prompts, params)
    spec = {"method": "dflash", "model": str(draft), "adaptive": False}
    paused = LLM(model=str(target), dtype="float32", kv_cache_memory="16MiB",
                 speculative_config={**spec, "disable_by_batch_size": 2})
    out = paused.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    # three requests run together from the first step, so no step ever drafts
    assert paused.get_spec_decoding_stats().num_drafts == 0
    alone = LLM(model=str(target), dtype="float32", kv_cache_memory="16MiB",
                speculative_config={**spec, "disable_by_batch_size": 3})
    assert [o.outputs[0].token_ids for o in alone.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in base]
    assert alone.get_spec_decoding_stats().num_drafts > 0
