"""A DFlash proposal for a request that wants only its first few drafts runs only the block
rows those drafts need (``models.dflash.BlockRows``: the draft's last layer writes every row's
K/V but runs the kept rows' queries, projection and MLP alone, and the head scores only them).
Every kept state, and so every draft, must be bitwise what the whole block gives (laid out
per block, engine.spec.tree_order: the whole block's nodes of those slots, in its order), and the
engine's output must stay the target's own."""

from __future__ import annotations

import pytest
import torch

from engine.spec.controller import Decision, SpecController
from engine.spec.tree import window_depths

from .helpers import (
    add_draft_vocab,
    assert_same_tokens,
    greedy,
    make_llm,
    random_prompts,
    save_draft,
    token_ids,
)

PROMPTS = random_prompts([3, 9, 17, 26], seed=83)
MAX_TOKENS = [24, 30, 18, 27]
TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0], [2]]


class CyclingCounts(SpecController):
    """Verifies everything held and asks each request for a different number of drafts at
    every step (0 .. all, in turn), so batches mix trimmed, whole and absent blocks."""

    def __init__(self, base: SpecController) -> None:
        super().__init__(base.k_max, base.acceptance, None, base.stats, adaptive=False,
                         tree=base.tree)
        self.step = 0

    def plan(self, cands, other_tokens=0):
        self.step += 1
        return [Decision(min(c.available, c.cap), (self.step + i) % (self.k_max + 1))
                for i, c in enumerate(cands)]

    def fresh_request_drafts(self, batch_rows):
        return self.step % (self.k_max + 1)


@pytest.mark.parametrize("layers,tree,reduced,order", [
    (1, None, False, "fixed"), (2, None, True, "fixed"), (1, TREE, True, "fixed"),
    (2, TREE, False, "fixed"), (1, TREE, True, "confidence"), (2, TREE, False, "confidence")])
def test_trimmed_blocks_are_bitwise_the_whole_blocks(tmp_path, qwen3_target, baseline_cache,
                                                     layers, tree, reduced, order):
    draft = tmp_path / "draft"
    save_draft(draft, seed=31 + layers, layers=layers)
    if reduced:
        add_draft_vocab(draft, range(0, 256, 2))
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3,
            "tree_order": order}
    if tree is not None:
        spec["tree"] = tree
    llm = make_llm(qwen3_target, spec)
    prop = llm.engine.proposer
    assert prop._trim_rows
    llm.engine.scheduler.controller = CyclingCounts(llm.engine.scheduler.controller)
    q_len = prop.num_speculative_tokens + 1
    rows_pass, choose_rows = prop._rows_pass, prop.choose_rows
    whole: dict[str, torch.Tensor] = {}
    seen: list[tuple[list[int], list[int]]] = []

    def checked_pass(ids, positions, batch, rows):
        meta = prop._backend.build_metadata(batch, prop.device)
        whole["states"], = prop._block_pass(ids, positions, meta)
        got = rows_pass(ids, positions, batch, rows)
        keep = [i * q_len + 1 + j for i, r in enumerate(rows) for j in range(r)]
        assert torch.equal(got, whole["states"][keep])
        return got

    def checked_choice(reqs, hidden, rows, counts):
        got = choose_rows(reqs, hidden, rows, counts)
        windows = dict(prop.windows)
        # every draft from the whole blocks, as ``choose`` takes them
        n, deepest = len(reqs), prop._rows_for[-1]
        states = whole["states"].view(n, q_len, -1)[:, 1:deepest + 1].reshape(n * deepest, -1)
        every = choose_rows(reqs, states, [deepest] * n, [prop.num_drafts] * n)
        for req, r, c in zip(reqs, rows, counts):
            rid = req.request_id
            if order == "fixed":
                assert len(got[rid]) == c
                assert got[rid] == every[rid][:c]
                continue
            # laid out per block: every node of the scored slots, in the whole block's order
            depths = window_depths(prop.windows[rid].parents)[1:]
            kept = [j for j, d in enumerate(depths) if d <= r]
            assert len(got[rid]) == len(kept) >= c
            assert got[rid] == [every[rid][j] for j in kept]
            row = {j: i for i, j in enumerate(kept, start=1)}
            whole_parents = prop.windows[rid].parents
            assert windows[rid].parents == [row[whole_parents[j] - 1] if whole_parents[j] else 0
                                            for j in kept]
        seen.append((rows, counts))
        return got

    prop._rows_pass, prop.choose_rows = checked_pass, checked_choice
    got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
    assert_same_tokens(got, baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS), "trimmed blocks")
    deepest = prop._rows_for[-1]
    # batches mixed requests wanting few drafts (fewer rows than the block) and all of them
    assert any(len(set(counts)) > 1 for _, counts in seen)
    assert any(r < deepest for rows, _ in seen for r in rows)
    assert any(c == prop.num_drafts for _, counts in seen for c in counts)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > 0
