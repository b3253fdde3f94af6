"""Speculative sampling reproduces the target's distribution (empirical, many seeds).

A 16-token target, a fixed prompt and 3 generated tokens; the exact distribution comes from
the Hugging Face model. Proposers: an oracle proposing the target's most likely tokens (so
drafts are accepted often and the acceptance rule matters), and a random DFlash draft."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import SamplingParams

from .helpers import chi_square_pvalue, make_llm, save_draft, save_target

VOCAB = 16
PROMPT = [1, 5, 9, 3, 7]
N = 2000
K = 2
SETTINGS = {
    "t1": {"temperature": 1.0},
    "t07_topk_topp": {"temperature": 0.7, "top_k": 6, "top_p": 0.9},
}


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("spec-v16"), "qwen3", vocab=VOCAB, hidden=32,
                       layers=2, seed=3, init=0.3, max_positions=64)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec-v16-draft")
    save_draft(folder, seed=4, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48,
               layers=1, block_size=3, target_layer_ids=(0, 1), num_target_layers=2,
               mask_token_id=VOCAB - 1, vocab=VOCAB)
    return folder


@pytest.fixture(scope="module")
def hf_target(small_target):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(small_target, dtype=torch.float32).eval()


def _processed_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Reference sampling distribution: temperature, then top-k, then top-p (smallest set of
    most likely tokens whose mass reaches top_p), renormalised. Rows of ``logits`` [N, V]."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sp, order = probs.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p
        sp = torch.where(keep, sp, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.fixture(scope="module")
def exact(hf_target):
    """Exact P(t1, t2) and P(t3) for every setting."""
    seqs2 = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
    seqs3 = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.inference_mode():
        l1 = hf_target(torch.tensor([PROMPT])).logits[:, -1]
        l2 = hf_target(seqs2).logits[:, -1]
        l3 = hf_target(seqs3).logits[:, -1]
    out = {}
    for name, s in SETTINGS.items():
        p1 = _processed_probs(l1, **s)[0]
        p2 = _processed_probs(l2, **s)
        p3 = _processed_probs(l3, **s)
        joint12 = p1[:, None] * p2  # [V, V]
        marg3 = (joint12.reshape(-1, 1) * p3).sum(0)
        out[name] = (
            {(a, b): float(joint12[a, b]) for a in range(VOCAB) for b in range(VOCAB)},
            {c: float(marg3[c]) for c in range(VOCAB)},
        )
    return out


class MostLikelyProposer:
    """Proposes the target's greedy continuation of the current context (computed with the
    Hugging Face model), so that sampled tokens often equal the drafts."""

    capture_layers = ()
    lookahead_slots = 0
    draft_seconds = 0.0
    windows: dict[str, list[int]] = {}  # chains (or a tree in its fixed order) only

    def __init__(self, hf, k):
        self.hf, self.num_speculative_tokens = hf, k
        self.memo: dict[tuple, list[int]] = {}

    def layer_specs(self):
        return []

    def bind(self, pool, backend):
        return None

    def _greedy(self, ctx: tuple) -> list[int]:
        if ctx not in self.memo:
            ids = list(ctx)
            with torch.inference_mode():
                for _ in range(self.num_speculative_tokens):
                    ids.append(int(self.hf(torch.tensor([ids])).logits[0, -1].argmax()))
            self.memo[ctx] = ids[len(ctx):]
        return self.memo[ctx]

    def propose(self, items, captured):
        out = {}
        for it in items:
            if it.sampled:
                req = it.item.request
                out[req.request_id] = self._greedy(
                    tuple(req.prompt_token_ids + req.output_token_ids + it.sampled))
        return out


def _sample(llm, setting, n=N, seed0=0):
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=seed0 + i, **SETTINGS[setting])
              for i in range(n)]
    return [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT] * n, params)]


def _llm(model, spec=None):
    return make_llm(model, spec, max_num_seqs=512, max_num_batched_tokens=4096, max_model_len=32)


def _check_distribution(samples, exact_setting, label):
    joint, marg3 = exact_setting
    assert all(len(s) == 3 for s in samples)
    c12 = Counter((s[0], s[1]) for s in samples)
    c3 = Counter(s[2] for s in samples)
    for what, counts, probs in (("(t1,t2)", c12, joint), ("t3", c3, marg3)):
        stat, p, dof = chi_square_pvalue(counts, probs, len(samples))
        assert p > 1e-4, f"{label} {what}: chi-square {stat:.1f} on {dof} dof, p={p:.2e}"
        tv = 0.5 * sum(abs(counts.get(k, 0) / len(samples) - probs.get(k, 0.0))
                       for k in set(counts) | set(probs))
        assert tv < 0.12, f"{label} {what}: total variation {tv:.3f}"


def test_chi_square_helper_has_power(exact):
    """The check rejects a distribution distorted the way a biased acceptance rule would
    (mass moved towards the most likely token), at this sample size."""
    _joint, marg3 = exact["t1"]
    top = max(marg3, key=marg3.get)
    biased = {c: 0.8 * p + (0.2 if c == top else 0.0) for c, p in marg3.items()}
    counts = Counter({c: round(N * p) for c, p in biased.items()})
    assert chi_square_pvalue(counts, marg3, sum(counts.values()))[1] < 1e-6
    fair = Counter({c: round(N * p) for c, p in marg3.items()})
    assert chi_square_pvalue(fair, marg3, sum(fair.values()))[1] > 0.5


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampling_with_oracle_matches_target(small_target, hf_target, exact, setting):
    llm = _llm(small_target, {"method": "ngram", "num_speculative_tokens": K})
    llm.engine.runner.proposer = MostLikelyProposer(hf_target, K)
    samples = _sample(llm, setting)
    stats = llm.get_spec_decoding_stats()
    # acceptance happens often, so the acceptance rule is really exercised
    assert stats.num_accepted_tokens > 0.2 * stats.num_draft_tokens > 0
    _check_distribution(samples, exact[setting], f"oracle {setting}")


def test_sampling_without_spec_matches_target(small_target, exact):
    _check_distribution(_sample(_llm(small_target), "t1", seed0=20_000), exact["t1"], "no spec t1")


def test_sampling_with_dflash_matches_target(small_target, small_draft, exact):
    llm = _llm(small_target, {"method": "dflash", "model": str(small_draft),
                              "num_speculative_tokens": K})
    samples = _sample(llm, "t07_topk_topp", seed0=50_000)
    assert llm.get_spec_decoding_stats().num_drafts > 0
    _check_distribution(samples, exact["t07_topk_topp"], "dflash t0.7")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_seeded_sampling_is_identical_with_and_without_spec(small_target, hf_target, setting):
    """Verification consumes a seeded request's generator exactly as plain decoding does."""
    n = 300
    base = _sample(_llm(small_target), setting, n, seed0=7)
    llm = _llm(small_target, {"method": "ngram", "num_speculative_tokens": K})
    llm.engine.runner.proposer = MostLikelyProposer(hf_target, K)
    spec = _sample(llm, setting, n, seed0=7)
    same = sum(a == b for a, b in zip(base, spec))
    assert same == n, f"{n - same} of {n} seeded requests differ"
    assert llm.get_spec_decoding_stats().num_accepted_tokens > 0
    assert not math.isnan(llm.get_spec_decoding_stats().mean_acceptance_length)


def test_seeded_sampling_under_preemption_and_mixed_batch(qwen3_target, draft_dir):
    """A batch mixing greedy and seeded requests, with a DFlash draft, preemption and chunked
    prefill, gives the same tokens per request as plain decoding with a roomy pool."""
    from .helpers import random_prompts

    prompts = random_prompts([3, 17, 9, 30, 12, 21], seed=61)
    params = []
    for i in range(len(prompts)):
        if i % 2:
            params.append(SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=28, temperature=0.9, top_p=0.95, top_k=50,
                                         seed=100 + i, ignore_eos=True))
    base = make_llm(qwen3_target, None)
    want = [list(o.outputs[0].token_ids) for o in base.generate(prompts, params)]
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                                  "num_speculative_tokens": 3},
                   block_size=8, num_kv_blocks=9, max_model_len=64, max_num_batched_tokens=12)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert llm.engine.num_preemptions > 0
    assert got == want


class MostLikelyTreeProposer(MostLikelyProposer):
    """A tree of drafts from the target itself: slot ``d``'s candidates are the target's
    ``r``-th most likely tokens after the greedy continuation's first ``d - 1`` tokens (like a
    DFlash block, they do not depend on which candidate an earlier slot took), so sampled
    tokens often match a second-rank node and the tree walk decides many windows."""

    def __init__(self, hf, tree):
        super().__init__(hf, tree.max_depth)
        self.tree = tree
        self.num_drafts = tree.num_nodes
        self.ranked: dict[tuple, list[list[int]]] = {}

    def _candidates(self, ctx: tuple) -> list[list[int]]:
        if ctx not in self.ranked:
            ids = list(ctx) + self._greedy(ctx)
            with torch.inference_mode():
                logits = self.hf(torch.tensor([ids])).logits[0]
            width = self.tree.max_rank + 1
            self.ranked[ctx] = [logits[len(ctx) - 1 + d].topk(width).indices.tolist()
                                for d in range(self.tree.max_depth)]
        return self.ranked[ctx]

    def propose(self, items, captured):
        out = {}
        for it in items:
            if it.sampled:
                req = it.item.request
                cand = self._candidates(
                    tuple(req.prompt_token_ids + req.output_token_ids + it.sampled))
                out[req.request_id] = [cand[d - 1][r]
                                       for d, r in zip(self.tree.depths, self.tree.ranks)]
        return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampling_with_a_tree_of_drafts_matches_target(small_target, small_draft, hf_target,
                                                       exact, setting):
    """Sampling the target at every node and following the child that drew the same token
    (engine.spec.tree) keeps the target's distribution."""
    llm = _llm(small_target, {"method": "dflash", "model": str(small_draft),
                              "num_speculative_tokens": K,
                              "tree": [[0], [1], [0, 0], [2], [1, 0], [0, 1]]})
    proposer = MostLikelyTreeProposer(hf_target, llm.engine.proposer.tree)
    llm.engine.runner.proposer = proposer
    samples = _sample(llm, setting, seed0=70_000)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_accepted_tokens > 0.2 * stats.num_drafts > 0
    _check_distribution(samples, exact[setting], f"tree {setting}")
