"""Serving DFlash2 drafts: a random reference-built draft keeps greedy output exact, seeded
sampling stays identical to plain decoding, and sampled drafts verified by rejection sampling
against the selector's q reproduce the target's distribution (chi-square)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import SamplingParams
from engine.config import ConfigError
from engine.spec import rejection
from engine.spec.dflash2 import DFlash2Proposer

from .helpers import (
    assert_same_tokens,
    chi_square_pvalue,
    greedy,
    make_llm,
    random_prompts,
    save_target,
    token_ids,
)
from .test_spec_dflash2_parity import save_dflash2
from .test_spec_sampling import PROMPT, SETTINGS, VOCAB, _check_distribution, _llm, _processed_probs


@pytest.fixture(scope="module")
def dflash2_dir(tmp_path_factory):
    """Random DFlash2 draft for the tiny 256-token targets (2 layers, block size 4)."""
    folder = tmp_path_factory.mktemp("dflash2-draft")
    save_dflash2(folder, seed=31, init=0.3, dflash2={"conv_kernel_size": 3, "conv_group_size": 16,
                                                     "selector_rank": 8, "selector_top_k": 8})
    return folder


@pytest.mark.parametrize("target", ["qwen3_target", "llama_target"])
@pytest.mark.parametrize("method,k", [("dflash", 3), ("dflash2", 1), ("dflash", 2)])
def test_greedy_output_equals_plain_greedy(request, target, method, k, dflash2_dir, baseline_cache):
    model = request.getfixturevalue(target)
    prompts = random_prompts([5, 23, 11, 40], seed=71)
    max_tokens = [30, 17, 26, 9]
    want = baseline_cache(model, prompts, max_tokens)
    llm = make_llm(model, {"method": method, "model": str(dflash2_dir), "num_speculative_tokens": k,
                           "adaptive": False})
    assert isinstance(llm.engine.proposer, DFlash2Proposer)
    got = token_ids(llm.generate(prompts, [greedy(m) for m in max_tokens]))
    assert_same_tokens(got, want, f"{target} {method} k={k}")
    assert llm.get_spec_decoding_stats().num_drafts > 0


def test_greedy_with_preemption_and_chunked_prefill(qwen3_target, dflash2_dir, baseline_cache):
    prompts = random_prompts([3, 17, 9, 30, 12, 21], seed=61)
    max_tokens = [28] * 6
    want = baseline_cache(qwen3_target, prompts, max_tokens)
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(dflash2_dir),
                                  "num_speculative_tokens": 3, "adaptive": False},
                   block_size=8, num_kv_blocks=9, max_model_len=64, max_num_batched_tokens=12)
    got = token_ids(llm.generate(prompts, [greedy(m) for m in max_tokens]))
    assert llm.engine.num_preemptions > 0
    assert_same_tokens(got, want, "preemption")


def test_method_dflash2_needs_a_dflash2_draft(qwen3_target, draft_dir):
    with pytest.raises(ConfigError, match="DFlash2 draft"):
        make_llm(qwen3_target, {"method": "dflash2", "model": str(draft_dir)})


def test_seeded_sampling_is_identical_with_and_without_dflash2(qwen3_target, dflash2_dir):
    """Seeded requests get the selector's greedy path (no q): their output is plain decoding's."""
    prompts = random_prompts([4, 19, 8], seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=300 + i,
                             ignore_eos=True) for i in range(3)]
    want = token_ids(make_llm(qwen3_target, None).generate(prompts, params))
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(dflash2_dir),
                                  "num_speculative_tokens": 3, "adaptive": False})
    assert token_ids(llm.generate(prompts, params)) == want
    assert llm.get_spec_decoding_stats().num_drafts > 0


# -- sampled drafts: rejection sampling -----------------------------------------------------


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("d2-v16"), "qwen3", vocab=VOCAB, hidden=32,
                       layers=2, seed=3, init=0.3, max_positions=64)


@pytest.fixture(scope="module")
def small_dflash2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("d2-v16-draft")
    save_dflash2(folder, seed=4, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48,
                 layers=1, block_size=3, target_layer_ids=(0, 1), num_target_layers=2,
                 mask_token_id=VOCAB - 1, vocab=VOCAB, init=0.3,
                 dflash2={"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4,
                          "selector_top_k": 6})
    return folder


@pytest.fixture(scope="module")
def exact(small_target):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(small_target, dtype=torch.float32).eval()
    seqs2 = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
    seqs3 = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.inference_mode():
        l1 = hf(torch.tensor([PROMPT])).logits[:, -1]
        l2 = hf(seqs2).logits[:, -1]
        l3 = hf(seqs3).logits[:, -1]
    out = {}
    for name, s in SETTINGS.items():
        p1 = _processed_probs(l1, **s)[0]
        p2 = _processed_probs(l2, **s)
        p3 = _processed_probs(l3, **s)
        joint12 = p1[:, None] * p2
        marg3 = (joint12.reshape(-1, 1) * p3).sum(0)
        out[name] = (
            {(a, b): float(joint12[a, b]) for a in range(VOCAB) for b in range(VOCAB)},
            {c: float(marg3[c]) for c in range(VOCAB)},
            hf,
        )
    return out


def _unseeded(llm, setting, n=2000):
    params = SamplingParams(max_tokens=3, ignore_eos=True, **SETTINGS[setting])
    return [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT] * n, params)]


class _Count:
    """Wraps rejection.verify to count verified and accepted drafts."""

    def __init__(self, monkeypatch):
        self.drafts = self.accepted = self.calls = 0
        inner = rejection.verify

        def counted(sampler, logits, group, proposal):
            res = inner(sampler, logits, group, proposal)
            self.calls += 1
            self.drafts += len(group.drafts)
            self.accepted += res.num_accepted
            return res

        monkeypatch.setattr(rejection, "verify", counted)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_dflash2_drafts_match_target(small_target, small_dflash2, exact, setting, monkeypatch):
    count = _Count(monkeypatch)
    llm = _llm(small_target, {"method": "dflash", "model": str(small_dflash2),
                              "num_speculative_tokens": 2, "adaptive": False})
    samples = _unseeded(llm, setting)
    # every window went through rejection sampling; a random draft's q is far from p (at t0.7
    # with top-k/top-p nearly disjoint), so most drafts are rejected and the residual
    # distribution carries this test; the accept branch is the next test's
    assert count.calls > 500 and count.accepted < count.drafts
    if setting == "t1":
        assert count.accepted > 0.03 * count.drafts
    _check_distribution(samples, exact[setting][:2], f"dflash2 {setting}")


class _NearTargetProposer:
    """Samples drafts from a distorted copy of the target's distribution (so acceptance is high
    but not certain) and records that q: exercises the rejection rule itself."""

    capture_layers = ()
    lookahead_slots = 0
    draft_seconds = 0.0
    windows: dict[str, list[int]] = {}  # chains (or a tree in its fixed order) only

    def __init__(self, hf, k, setting):
        self.hf, self.num_speculative_tokens, self.setting = hf, k, setting
        self.gen = torch.Generator().manual_seed(0)
        self.logits: dict[tuple[int, ...], torch.Tensor] = {}  # the same few contexts recur

    def _last_logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self.logits:
            with torch.inference_mode():
                self.logits[key] = self.hf(torch.tensor([ids])).logits[0, -1]
        return self.logits[key]

    def layer_specs(self):
        return []

    def bind(self, pool, backend):
        return None

    def propose(self, items, captured):
        out = {}
        for it in items:
            req = it.item.request
            rejection.discard(req)
            if not it.sampled:
                continue
            ids = req.prompt_token_ids + req.output_token_ids + it.sampled
            drafts, qs = [], []
            for _ in range(self.num_speculative_tokens):
                logits = self._last_logits(ids)
                # temperature 1.5 over the top 8, never the target's truncation: q != p
                q = torch.softmax(logits.topk(8).values / 1.5, -1)
                cand = logits.topk(8).indices
                j = int(torch.multinomial(q, 1, generator=self.gen))
                drafts.append(int(cand[j]))
                qs.append((cand, q))
                ids = ids + [drafts[-1]]
            rejection.record(req, rejection.Proposal(
                drafts, torch.stack([c for c, _ in qs]), torch.stack([q for _, q in qs])))
            out[req.request_id] = drafts
        return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_rejection_rule_with_a_near_target_q(small_target, exact, setting, monkeypatch):
    count = _Count(monkeypatch)
    llm = _llm(small_target, {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    llm.engine.runner.proposer = _NearTargetProposer(exact[setting][2], 2, setting)
    samples = _unseeded(llm, setting)
    assert count.calls > 500 and 0.3 * count.drafts < count.accepted < 0.95 * count.drafts
    _check_distribution(samples, exact[setting][:2], f"near-target q {setting}")


def test_stale_or_mismatched_proposals_are_not_used():
    from engine.request import Request

    req = Request("r", [1, 2], SamplingParams(temperature=1.0))
    prop = rejection.Proposal([5, 6, 7], torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2) / 2)
    rejection.record(req, prop)
    assert rejection.take(req, [5, 6]) is prop  # a trimmed window: a prefix is fine
    assert rejection.take(req, [5, 6]) is None  # taken once
    rejection.record(req, prop)
    assert rejection.take(req, [5, 9]) is None  # other drafts: not this proposal


def test_chi_square_helper_is_the_shared_one():
    # the same statistic as tests/spec/test_spec_sampling.py (sanity: a fair sample passes)
    probs = {0: 0.5, 1: 0.5}
    assert chi_square_pvalue(Counter({0: 500, 1: 500}), probs, 1000)[1] > 0.5


def test_reduced_draft_vocabulary_keeps_greedy_exact(qwen3_target, tmp_path, baseline_cache):
    """A DFlash2 draft with d2t: candidates are draft-vocabulary rows mapped to target ids,
    the codebooks are indexed by target id."""
    from .helpers import add_draft_vocab

    save_dflash2(tmp_path, seed=32, init=0.3)
    add_draft_vocab(tmp_path, list(range(3, 200, 2)))
    prompts = random_prompts([6, 15], seed=8)
    want = baseline_cache(qwen3_target, prompts, [20, 20])
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(tmp_path),
                                  "num_speculative_tokens": 3, "adaptive": False})
    proposer, proposed = llm.engine.proposer, []
    choose = proposer.choose

    def recorded(*a):
        out = choose(*a)
        proposed.extend(t for d in out.values() for t in d)
        return out

    proposer.choose = recorded
    got = token_ids(llm.generate(prompts, [greedy(20)] * 2))
    assert_same_tokens(got, want, "d2t")
    assert proposed and set(proposed) <= set(range(3, 200, 2))
    assert llm.get_spec_decoding_stats().num_drafts > 0


def test_rejection_path_with_logprobs_and_penalties(qwen3_target, dflash2_dir, monkeypatch):
    """Unseeded sampled requests with logprobs and penalties go through rejection sampling
    and return one logprob entry per token."""
    count = _Count(monkeypatch)
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(dflash2_dir),
                                  "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(max_tokens=16, temperature=1.0, logprobs=2, repetition_penalty=1.3,
                            presence_penalty=0.5, ignore_eos=True)
    outs = llm.generate(random_prompts([5, 9, 14], seed=9), params)
    assert count.calls > 0
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 16 and len(c.logprobs) == 16
        assert all(lp.token_id == t and len(lp.top) == 2 for lp, t in zip(c.logprobs, c.token_ids))
