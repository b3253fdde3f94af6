"""A draft with a reduced vocabulary (``draft_vocab_size`` + ``d2t``) proposes only ids from
that subset, keeps greedy output exact, and a malformed subset fails at startup."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import ConfigError
from models.llama import WeightLoadError

from .helpers import (
    TARGET_VOCAB,
    add_draft_vocab,
    assert_same_tokens,
    edit_json,
    greedy,
    make_llm,
    random_prompts,
    save_draft,
    token_ids,
)

PROMPTS = random_prompts([5, 17, 30])
MAX_TOKENS = [24, 31, 18]


def _spec(folder, k=3):
    return {"method": "dflash", "model": str(folder), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def vocab_draft(tmp_path_factory, qwen3_target):
    """A random draft restricted to the target's greedy tokens plus every third id: most
    proposals can be right, and the subset is far from the whole vocabulary."""
    folder = tmp_path_factory.mktemp("vocab_draft")
    save_draft(folder, seed=11)
    llm = make_llm(qwen3_target, None)
    seen = {t for out in token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
            for t in out}
    ids = sorted(seen | set(range(0, TARGET_VOCAB, 3)))
    add_draft_vocab(folder, ids)
    return folder, ids


def test_greedy_exact_and_proposals_from_the_subset(qwen3_target, baseline_cache, vocab_draft):
    folder, ids = vocab_draft
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, "auto")
    llm = make_llm(qwen3_target, _spec(folder))
    proposer = llm.engine.runner.proposer
    assert proposer.draft.draft_token_ids.tolist() == ids
    assert proposer._head.shape[0] == len(ids)
    proposed: list[int] = []
    real = proposer.propose

    def spy(items, captured):
        out = real(items, captured)
        for tokens in out.values():
            proposed.extend(tokens)
        return out

    proposer.propose = spy
    got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
    assert_same_tokens(got, want)
    assert proposed and set(proposed) <= set(ids)


def test_scores_equal_the_full_head_restricted_to_the_subset(qwen3_target, vocab_draft):
    """The sub-head is the target's LM head rows for the subset, nothing retrained."""
    folder, ids = vocab_draft
    llm = make_llm(qwen3_target, _spec(folder))
    proposer = llm.engine.runner.proposer
    full = proposer.target.lm_head_weight
    torch.testing.assert_close(proposer._head, full[torch.tensor(ids)], atol=0, rtol=0)


def _copy(vocab_draft, tmp_path):
    folder, ids = vocab_draft
    dst = tmp_path / "draft"
    shutil.copytree(folder, dst)
    return dst, ids


def test_d2t_beyond_the_target_vocabulary(qwen3_target, vocab_draft, tmp_path):
    dst, ids = _copy(vocab_draft, tmp_path)
    add_draft_vocab(dst, ids[:-1] + [TARGET_VOCAB + 5])
    with pytest.raises(ConfigError) as err:
        make_llm(qwen3_target, _spec(dst))
    assert "d2t" in str(err.value) and str(TARGET_VOCAB + 5) in str(err.value)
    assert err.value.param == "speculative_config.model"


def test_d2t_not_ascending(qwen3_target, vocab_draft, tmp_path):
    dst, ids = _copy(vocab_draft, tmp_path)
    add_draft_vocab(dst, [ids[1], ids[0]] + ids[2:])
    with pytest.raises(WeightLoadError, match="ascending"):
        make_llm(qwen3_target, _spec(dst))


def test_d2t_length_differs_from_config(qwen3_target, vocab_draft, tmp_path):
    dst, ids = _copy(vocab_draft, tmp_path)
    edit_json(dst / "config.json", draft_vocab_size=len(ids) - 1)
    with pytest.raises(WeightLoadError, match="draft_vocab_size"):
        make_llm(qwen3_target, _spec(dst))


def test_config_names_a_subset_but_weights_lack_d2t(qwen3_target, tmp_path):
    save_draft(tmp_path, seed=3)
    edit_json(tmp_path / "config.json", draft_vocab_size=100)
    with pytest.raises(WeightLoadError, match="d2t"):
        make_llm(qwen3_target, _spec(tmp_path))


def test_full_size_draft_vocab_means_no_subset(qwen3_target, tmp_path):
    save_draft(tmp_path, seed=3)
    edit_json(tmp_path / "config.json", draft_vocab_size=TARGET_VOCAB)
    llm = make_llm(qwen3_target, _spec(tmp_path))
    assert llm.engine.runner.proposer.draft.draft_token_ids is None
