"""The real SmolLM2-135M target with a random DFlash draft (two tests, float32)."""

from __future__ import annotations

import pytest

from .helpers import OracleProposer, assert_same_tokens, greedy, make_llm, save_draft, token_ids

REAL = "smollm2-135m-instruct"
PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 563, 12745, 30]]  # token ids
ARGS = {"max_model_len": 128, "kv_cache_memory": "32MiB"}


@pytest.fixture(scope="module")
def real_model():
    try:
        from models.resolve import resolve_model_path

        return resolve_model_path(REAL)
    except Exception as exc:  # noqa: BLE001 -- the folder is missing and cannot be built offline
        pytest.skip(f"real model unavailable: {exc}")


@pytest.fixture(scope="module")
def real_draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-random-draft")
    save_draft(folder, seed=3, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=256,
               layers=1, block_size=4, target_layer_ids=(1, 14, 27), num_target_layers=30,
               mask_token_id=0, vocab=49152, init=0.05, rope_theta=1e5)
    return folder


def _dflash(draft, dtype="auto"):
    return {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3,
            "kv_cache_dtype": dtype}


@pytest.mark.slow
def test_real_model_greedy_equal_and_stop_string(real_model, real_draft):
    base = make_llm(REAL, None, **ARGS)
    want = token_ids(base.generate(PROMPTS, greedy(24)))
    assert len(set(want[0])) > 4
    llm = make_llm(REAL, _dflash(real_draft), kv_cache_layout="NHD", **ARGS)
    assert_same_tokens(token_ids(llm.generate(PROMPTS, greedy(24))), want)
    assert llm.get_spec_decoding_stats().num_drafts > 0

    # a stop string met in the middle of a fully accepted block (oracle drafts): same text and
    # tokens as without speculation
    text = base.get_tokenizer().decode(want[0])
    assert len(text) > 20
    stop = text[len(text) // 2: len(text) // 2 + 3]
    plain = base.generate([PROMPTS[0]], greedy(24, stop=[stop]))[0].outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 24
    oracle_llm = make_llm(REAL, {"method": "ngram", "num_speculative_tokens": 5}, **ARGS)
    oracle_llm.engine.runner.proposer = OracleProposer({tuple(PROMPTS[0]): want[0]}, 5, 49152)
    got = oracle_llm.generate([PROMPTS[0]], greedy(24, stop=[stop]))[0].outputs[0]
    assert (got.text, list(got.token_ids)) == (plain.text, list(plain.token_ids))
    assert got.finish_reason == "stop" and got.stop_reason == stop
    stats = oracle_llm.get_spec_decoding_stats()
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.slow
def test_real_model_greedy_equal_fp8_target_bf16_draft_hnd(real_model, real_draft):
    want = token_ids(make_llm(REAL, None, kv_cache_dtype="fp8", **ARGS).generate(PROMPTS, greedy(24)))
    llm = make_llm(REAL, _dflash(real_draft, "bfloat16"), kv_cache_dtype="fp8",
                   kv_cache_layout="HND", **ARGS)
    assert_same_tokens(token_ids(llm.generate(PROMPTS, greedy(24))), want)
    pool = llm.engine.pool
    bs = llm.engine.config.cache.block_size  # HND: [blocks, K/V, heads, block, head_dim]
    assert pool.layer("target.layers.29").physical.shape[1:] == (2, 3, bs, 64)
    assert pool.layer("draft.layers.0").physical.dtype.__str__() == "torch.bfloat16"
    assert llm.get_spec_decoding_stats().num_drafts > 0
