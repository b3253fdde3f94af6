"""End to end through the engine: every DFlash proposal equals the reference draft's proposal
computed from scratch, and the draft's paged context K/V equals a from-scratch projection of
the target's features, while acceptance lengths vary over 0..K."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .helpers import (
    TARGET_VOCAB,
    OracleProposer,
    assert_same_tokens,
    greedy,
    make_llm,
    random_prompts,
    token_ids,
)

K = 3
PROMPTS = random_prompts([4, 11, 19], seed=51)
MAX_TOKENS = [26, 21, 17]


class SpyProposer:
    """Runs the real DFlash proposer (so it writes context and drafts), records what it
    proposed and the draft pages it holds, then returns oracle drafts wrong at a cycling
    position so that 0..K drafts get accepted."""

    def __init__(self, inner, oracle: OracleProposer, pool, draft_every: int = 1) -> None:
        self.inner, self.oracle, self.pool = inner, oracle, pool
        self.draft_every = draft_every  # > 1: most steps only update the draft context
        self.calls = 0
        self.num_speculative_tokens = inner.num_speculative_tokens
        self.capture_layers = inner.capture_layers
        self.lookahead_slots = inner.lookahead_slots
        self.records: list[dict] = []

    @property
    def draft_seconds(self) -> float:
        return self.inner.draft_seconds

    @property
    def windows(self) -> dict[str, list[int]]:
        return self.inner.windows

    def layer_specs(self):
        return self.inner.layer_specs()

    def bind(self, pool, backend):
        self.inner.bind(pool, backend)

    def propose(self, items, captured):
        self.calls += 1
        if self.draft_every > 1:  # each request on its own turn: the others' writes wait
            items = [dataclasses.replace(it, num_drafts=it.num_drafts if (self.calls + i)
                                         % self.draft_every == 0 else 0)
                     for i, it in enumerate(items)]
        drafted = self.inner.propose(items, captured)
        bs = self.pool.layer(self.inner.layer_names[0]).block_size
        for it in items:
            if not it.sampled or not it.num_drafts:
                continue
            req = it.item.request
            tokens = req.prompt_token_ids + req.output_token_ids + it.sampled
            p = it.start + it.num_valid
            pos = torch.arange(p)
            slots = torch.tensor(req.block_table)[pos // bs] * bs + pos % bs
            pages = [self.pool.layer(n).logical[slots // bs, :, slots % bs].clone()
                     for n in self.inner.layer_names]  # each [p, 2, Hkv, D]
            self.records.append({"rid": req.request_id, "tokens": list(tokens), "p": p,
                                     "drafts": drafted.get(req.request_id), "pages": pages})
        return self.oracle.propose(items, captured)


def _scratch_context(draft, feats):
    """Context K/V of ``feats`` (positions 0..p-1) written by the draft into a fresh pool."""
    from attention.groups import LayerKVSpec, build_groups
    from engine.kv_pool import KVPool

    c, p, bs = draft.config, feats.shape[0], 4
    names = [f"draft.layers.{i}" for i in range(c.num_layers)]
    specs = [LayerKVSpec(n, "draft", c.num_kv_heads, c.head_dim, "auto", bs) for n in names]
    pool = KVPool(list(build_groups(specs, torch.float32).values()), -(-p // bs), "NHD",
                  torch.device("cpu"))
    kvs = pool.layers(names)
    slots = torch.arange(p)
    with torch.inference_mode():
        draft.write_context(feats, torch.arange(p), slots, kvs)
    return [kv.logical[slots // bs, :, slots % bs] for kv in kvs]


@pytest.fixture(scope="module")
def hf_target(qwen3_target):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mask_embedding_draft(tmp_path_factory):
    """A draft whose MASK slots use its own vector (mask id 7 is a real, ordinary token)."""
    from .helpers import save_draft

    folder = tmp_path_factory.mktemp("spec-draft-maskvec")
    vec = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 2
    save_draft(folder, seed=23, mask_token_id=7, mask_embedding=vec)
    return folder, vec


@pytest.mark.parametrize("layout,variant", [("NHD", "mask_token"), ("HND", "mask_token"),
                                            ("HND", "mask_embedding"), ("NHD", "preempt_chunked"),
                                            ("NHD", "deferred_context")])
def test_dflash_proposals_and_draft_cache_match_reference(qwen3_target, draft_dir, hf_target,
                                                          mask_embedding_draft, baseline_cache,
                                                          layout, variant):
    from dflash.model import DFlashDraftModel as RefDraft

    mask_vec = None
    if variant == "mask_embedding":
        draft_dir, mask_vec = mask_embedding_draft
    target = hf_target
    ref = RefDraft.from_pretrained(draft_dir, dtype=torch.float32).eval()
    long = baseline_cache(qwen3_target, PROMPTS, [m + K for m in MAX_TOKENS], "auto")
    futures = {tuple(p): f for p, f in zip(PROMPTS, long)}

    extra = {}
    if variant in ("preempt_chunked", "deferred_context"):
        # recompute after preemption and prefill in chunks must rebuild the draft context too
        extra = {"block_size": 8, "num_kv_blocks": 9, "max_model_len": 64, "max_num_batched_tokens": 12}
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                                  "num_speculative_tokens": K}, kv_cache_layout=layout, **extra)
    engine = llm.engine
    inner = engine.runner.proposer
    oracle = OracleProposer(futures, K, TARGET_VOCAB,
                            corrupt=lambda call, rid: (call % (K + 1)) if call % (K + 1) < K else None)
    # deferred_context: each request drafts every 5th step only, the requests on different
    # steps, so a request's context writes wait over the others' proposals, preemptions and
    # page reuse, and land in one batch before its own next proposal
    spy = SpyProposer(inner, oracle, engine.pool, 5 if variant == "deferred_context" else 1)
    engine.runner.proposer = spy
    got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
    assert_same_tokens(got, [f[:m] for f, m in zip(long, MAX_TOKENS)])
    stats = llm.get_spec_decoding_stats()
    assert stats.num_accepted_tokens_per_pos[K - 1] > 0  # full blocks were accepted too
    if variant in ("preempt_chunked", "deferred_context"):
        assert engine.num_preemptions > 0

    taps = list(ref.target_layer_ids)
    mask = ref.mask_token_id
    lm_head = target.lm_head.weight
    embed = target.model.embed_tokens.weight
    mismatches = []
    assert len(spy.records) >= (4 if variant == "deferred_context" else 15)
    for rec in spy.records:
        tokens, p = rec["tokens"], rec["p"]
        assert p == len(tokens) - 1, "the block must start at the newest token's position"
        with torch.inference_mode():
            hs = target(torch.tensor([tokens[:p]]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i + 1][0] for i in taps], dim=-1)  # [p, taps*H]
            block = torch.tensor([tokens[p]] + [mask] * K)
            noise = embed[block].clone()
            if mask_vec is not None:
                noise[1:] = mask_vec  # the shipped vector replaces the MASK rows
            h = ref(position_ids=torch.arange(p + K + 1)[None],
                    noise_embedding=noise[None], target_hidden=feats[None])[0]
            logits = h[1:] @ lm_head.T
            want = logits.argmax(-1).tolist()
        if rec["drafts"] != want:
            # tolerate only a genuine near-tie in the reference logits
            for j, (a, b) in enumerate(zip(rec["drafts"], want)):
                if a != b and float(logits[j, b] - logits[j, a]) > 1e-3:
                    mismatches.append((rec["rid"], p, rec["drafts"], want))
                    break
        # the draft's pages hold, for every committed position, the context K/V of the
        # target features at that position (no stale block K/V, no missing accepted rows)
        for pages, scratch in zip(rec["pages"], _scratch_context(inner.draft, feats)):
            torch.testing.assert_close(pages, scratch, rtol=1e-4, atol=1e-4)
    assert not mismatches, mismatches[:3]
