"""Greedy output with speculative decoding equals greedy output without it, token for token."""

from __future__ import annotations

import pytest

from .helpers import assert_same_tokens, greedy, make_llm, random_prompts, token_ids

PROMPTS = random_prompts([1, 7, 12, 29, 41])
MAX_TOKENS = [30, 19, 26, 11, 33]
DTYPE_PAIRS = [("auto", "auto"), ("fp8", "bfloat16"), ("bfloat16", "fp8")]


def _dflash(draft, k=3, draft_dtype="auto"):
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": k}
    if draft_dtype != "auto":
        spec["kv_cache_dtype"] = draft_dtype
    return spec


def _run(llm, prompts, max_tokens):
    return token_ids(llm.generate(prompts, [greedy(m) for m in max_tokens]))


def _assert_spec_active(llm):
    stats = llm.get_spec_decoding_stats()
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0, stats


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("target_dtype,draft_dtype", DTYPE_PAIRS)
def test_greedy_equal_batch_and_alone(qwen3_target, draft_dir, baseline_cache, layout,
                                      target_dtype, draft_dtype):
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, target_dtype)
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3, draft_dtype),
                   kv_cache_dtype=target_dtype, kv_cache_layout=layout)
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want, "batch")
    _assert_spec_active(llm)
    # the same engine, one request at a time (short and long prompt)
    for i in (0, 4):
        assert_same_tokens(_run(llm, [PROMPTS[i]], [MAX_TOKENS[i]]), [want[i]], f"alone #{i}")


@pytest.mark.parametrize("layout,target_dtype,draft_dtype",
                         [("NHD", "auto", "auto"), ("HND", "fp8", "bfloat16"),
                          ("NHD", "bfloat16", "fp8")])
def test_greedy_equal_under_preemption(qwen3_target, draft_dir, baseline_cache, layout,
                                       target_dtype, draft_dtype):
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, target_dtype)
    # block size 8, 14 blocks: one request fits (max_model_len 96 + 4 look-ahead = 13 blocks)
    # but the batch needs ~31, so requests are preempted and recomputed
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3, draft_dtype), kv_cache_dtype=target_dtype,
                   kv_cache_layout=layout, block_size=8, num_kv_blocks=14, max_model_len=96)
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want, "preempted batch")
    assert llm.engine.num_preemptions > 0
    _assert_spec_active(llm)


@pytest.mark.parametrize("layout,target_dtype,draft_dtype",
                         [("HND", "auto", "auto"), ("NHD", "fp8", "bfloat16")])
def test_greedy_equal_with_chunked_prefill(qwen3_target, draft_dir, baseline_cache, layout,
                                           target_dtype, draft_dtype):
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, target_dtype)
    # a token budget of 7 splits the 12-, 29- and 41-token prompts into chunks that run next to
    # other requests' verify windows (1 + 3 tokens)
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3, draft_dtype), kv_cache_dtype=target_dtype,
                   kv_cache_layout=layout, max_num_batched_tokens=7)
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want, "chunked batch")
    _assert_spec_active(llm)


@pytest.mark.parametrize("budget", [2, 3])
def test_greedy_equal_with_budget_smaller_than_verify_window(qwen3_target, draft_dir,
                                                             baseline_cache, budget):
    """A token budget below 1+K trims the drafts to budget-1 (and chunks every prompt)."""
    want = baseline_cache(qwen3_target, PROMPTS[:3], MAX_TOKENS[:3], "auto")
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3), max_num_batched_tokens=budget)
    assert_same_tokens(_run(llm, PROMPTS[:3], MAX_TOKENS[:3]), want)
    stats = llm.get_spec_decoding_stats()
    assert 0 < stats.num_draft_tokens <= stats.num_drafts * (budget - 1)


def test_greedy_equal_chunked_prefill_and_preemption_together(qwen3_target, draft_dir,
                                                               baseline_cache):
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3), block_size=8, num_kv_blocks=14,
                   max_model_len=96, max_num_batched_tokens=16, kv_cache_layout="HND")
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want)
    assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 2, None])
def test_greedy_equal_with_fewer_spec_tokens_than_block(qwen3_target, draft_b8_dir,
                                                        baseline_cache, k):
    """Draft block size 8: K = 1 and 2 are below B-1 = 7; None takes the default B-1."""
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    spec = {"method": "dflash", "model": str(draft_b8_dir)}
    if k is not None:
        spec["num_speculative_tokens"] = k
    llm = make_llm(qwen3_target, spec)
    assert llm.engine.runner.proposer.num_speculative_tokens == (k or 7)
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_spec_tokens == (k or 7)
    assert stats.num_draft_tokens <= stats.num_drafts * (k or 7)
    assert stats.num_draft_tokens > stats.num_drafts * ((k or 7) - 1) * 0.5


def test_greedy_equal_few_running_slots(qwen3_target, draft_dir, baseline_cache):
    """max_num_seqs=2: requests wait, join later and reuse freed blocks (stale draft pages)."""
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3), max_num_seqs=2)
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want)


def test_greedy_equal_llama_target(llama_target, draft_dir, baseline_cache):
    want = baseline_cache(llama_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(llama_target, _dflash(draft_dir, 3, "bfloat16"), kv_cache_layout="HND")
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want)
    _assert_spec_active(llm)


def test_greedy_baseline_is_not_degenerate(qwen3_target, baseline_cache):
    """Guard: the comparisons above only mean something if outputs vary."""
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    for out in want:
        if len(out) >= 10:
            assert len(set(out)) >= len(out) // 3, out


def test_greedy_equal_with_stop_token_ids_and_dflash(qwen3_target, draft_dir, baseline_cache):
    """A stop id cuts the output right after its first occurrence, with a DFlash draft."""
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(qwen3_target, _dflash(draft_dir, 3))
    i = 4
    stop = want[i][9]
    cut = want[i].index(stop) + 1
    out = llm.generate([PROMPTS[i]], greedy(MAX_TOKENS[i], stop_token_ids=[stop]))[0].outputs[0]
    assert list(out.token_ids) == want[i][:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_greedy_equal_with_mask_embedding_draft(qwen3_target, baseline_cache, tmp_path):
    """A draft without a usable mask id that ships mask_embedding.safetensors serves."""
    import torch

    from .helpers import save_draft

    save_draft(tmp_path, seed=5, mask_token_id=None, mask_embedding=torch.randn(64))
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(qwen3_target, _dflash(tmp_path, 3))
    assert llm.engine.runner.proposer.draft.mask_embedding is not None
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want)


def test_greedy_equal_with_a_refining_draft(qwen3_target, baseline_cache, tmp_path):
    """A draft whose config asks for a refinement pass runs two block passes per proposal
    (through the same paged look-ahead slots) and stays exact."""
    import json

    from .helpers import save_draft

    save_draft(tmp_path, seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["refine_passes"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(qwen3_target, _dflash(tmp_path, 3))
    proposer = llm.engine.runner.proposer
    assert proposer.draft.config.refine_passes == 1
    calls = {"block": 0, "draft": 0}
    real_block, real_forward = proposer._block_pass, proposer.draft.forward

    def block_pass(*args, **kwargs):
        calls["block"] += 1
        return real_block(*args, **kwargs)

    def forward(*args, **kwargs):
        calls["draft"] += 1
        return real_forward(*args, **kwargs)

    proposer._block_pass, proposer.draft.forward = block_pass, forward
    assert_same_tokens(_run(llm, PROMPTS, MAX_TOKENS), want)
    _assert_spec_active(llm)
    assert calls["block"] > 0 and calls["draft"] == 2 * calls["block"]
