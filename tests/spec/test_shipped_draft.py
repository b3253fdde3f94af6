"""The shipped DFlash draft for the default model: exact output, and it really speculates."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.args import default_draft_for

QUESTIONS = [
    "Tom has 3 boxes with 12 apples each. He gives away 10 apples. How many apples does he have left?",
    "A train travels 60 miles per hour for 3 hours. How far does it travel?",
    "Sara buys 4 notebooks at $2 each and a pen for $3. How much does she spend in total?",
]


@pytest.fixture(scope="module")
def prompts():
    draft = default_draft_for("smollm2-135m-instruct")
    assert draft is not None, "the default model must ship its DFlash draft"
    from models.hf_folder import load_tokenizer
    from models.resolve import resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) for q in QUESTIONS]


def test_shipped_draft_is_exact_and_accepts(prompts):
    params = SamplingParams(max_tokens=48, temperature=0)
    common = dict(model="smollm2-135m-instruct", dtype="float32", max_model_len=1024,
                  kv_cache_memory="128MiB")
    default_llm = LLM(**common)  # the default speculative config: the shipped draft, adaptive
    default = default_llm.engine
    assert default.config.speculative.method == "dflash"
    assert default.config.speculative.adaptive
    assert default.config.speculative.model == str(default_draft_for("smollm2-135m-instruct"))
    proposer = default.proposer
    assert proposer.num_speculative_tokens == 7
    # it offers a tree of drafts (tree.json beside it), the first node the greedy draft
    assert proposer.tree is not None and proposer.num_drafts == proposer.tree.num_nodes == 32
    assert proposer.tree.paths[:2] == ((0,), (0, 0))
    # it scores a reduced vocabulary: a slice of the target's LM head, not all 49152 rows
    assert proposer.draft.draft_token_ids is not None
    assert proposer._head.shape[0] == proposer.draft.config.draft_vocab_size < 49152
    # acceptance of the draft itself, verifying its whole tree every step (fixed), and as a
    # chain of all 7 drafts
    draft = default.config.speculative.model
    spec = LLM(speculative_config={"method": "dflash", "model": draft, "adaptive": False},
               **common)
    chain = LLM(speculative_config={"method": "dflash", "model": draft, "adaptive": False,
                                    "tree": "chain"}, **common)
    plain = LLM(speculative_config="none", **common)
    assert plain.engine.proposer is None
    for prompt in prompts:  # one at a time: single-stream decoding, as served
        want = plain.generate([prompt], params)[0].outputs[0].token_ids
        assert spec.generate([prompt], params)[0].outputs[0].token_ids == want
        assert chain.generate([prompt], params)[0].outputs[0].token_ids == want
        assert default_llm.generate([prompt], params)[0].outputs[0].token_ids == want
    # all three prompts at once through the adaptive default: still the same tokens
    together = default_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    stats = spec.get_spec_decoding_stats()
    assert stats.num_drafts > 0
    assert stats.mean_acceptance_length > 1.5, stats
    # the tree accepts more than the chain on the same prompts
    chained = chain.get_spec_decoding_stats()
    assert stats.mean_acceptance_length > chained.mean_acceptance_length, (stats, chained)
