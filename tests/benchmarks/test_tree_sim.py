"""The tree simulation: acceptance of chains and trees on known ranks, the frequency tree, and
its speed arithmetic."""

from __future__ import annotations

import pytest

from benchmarks import tree_sim as ts


def test_chain_and_tree_accept_the_matching_prefix():
    ranks = [0, 1, 0, 0]
    assert ts.chain_accepts(ranks, 4) == 1 and ts.chain_accepts(ranks, 0) == 0
    assert ts.tree_accepts(ranks, {(0,), (0, 0)}) == 1
    assert ts.tree_accepts(ranks, {(0,), (0, 1), (0, 1, 0)}) == 3
    assert ts.tree_accepts(ranks, {(1,), (1, 1)}) == 0


def test_walk_moves_by_accepted_plus_one_from_the_first_response_token():
    # accepted drafts per position with a chain of 3: 2, x, x, 0, 3, x, x, x, 1, x
    ranks = [[0, 0, 1], [9, 9, 9], [9, 9, 9], [1, 0, 0], [0, 0, 0],
             [9, 9, 9], [9, 9, 9], [9, 9, 9], [0, 2, 0], [9, 9, 9]]
    # 0 (+3) -> 3 (+1) -> 4 (+4) -> 8 (+2) -> 10: 10 tokens in 4 steps
    assert ts.walk([ranks], lambda r: ts.chain_accepts(r, 3)) == pytest.approx(10 / 4)


def test_frequency_tree_takes_the_commonest_prefixes_and_keeps_parents():
    seqs = [[[0, 0, 5], [0, 0, 5], [0, 1, 5], [1, 0, 5], [1, 0, 5], [2, 5, 5]]]
    # counts: (0,) 3, (1,) 2, (0,0) 2, (1,0) 2, (0,1) 1, (2,) 1, (0,0,5)... never (5 >= max_rank)
    assert ts.frequency_tree(seqs, 1, max_rank=5) == [(0,)]
    assert ts.frequency_tree(seqs, 3, max_rank=5) == [(0,), (1,), (0, 0)]
    tree = ts.frequency_tree(seqs, 6, max_rank=5)
    assert tree == [(0,), (1,), (0, 0), (1, 0), (2,), (0, 1)]  # by count, then depth, ranks
    assert all(len(p) == 1 or tree.index(p[:-1]) < tree.index(p) for p in tree)


def test_tree_file_orders_paths_and_counts_acceptance_along_the_walk():
    from engine.spec.tree import DraftTree

    # counts (0,) 3, (0, 0) 2, then (1,) first of the ones seen once
    ranks = [[0, 0, 3], [0, 0, 9], [0, 1, 9], [1, 9, 9], [9, 9, 9]]
    data = ts.tree_file([ranks], 3)
    assert data["paths"] == [[0], [0, 0], [1]]
    # the walk visits 0 (accepts 2) and 3 (accepts (1,)): (0,) hit 1 of 2, (0, 0) 1 of 1
    # (tried only where (0,) was accepted), (1,) 1 of 2
    assert data["conditional"] == [0.5, 1.0, 0.5]
    DraftTree.from_paths(data["paths"], data["conditional"])  # the engine reads it


def test_simulate_prices_rows_and_extrapolates_past_the_measured_costs():
    seqs = [[[0, 0, 0]] * 8, [[1, 0, 0]] * 8]
    costs = [10.0, 10.0, 11.0, 12.0]
    rows = {r["kind"]: r for r in ts.simulate(seqs, [2], 0.5, costs, draft_ms=2.0, row_ms=1.0)}
    # measured on the second sequence only, whose slot 1 is always rank 1: chains gain nothing
    assert rows["chain K=3"]["accept"] == 1.0
    assert rows["chain K=3"]["speed"] == pytest.approx(10.0 / 14.0)
    # fitted on the first: the tree is (0,), (0, 0), missing the rank-1 path too
    assert rows["tree, 2 nodes, depth 2"]["accept"] == 1.0
    assert ts.step_ms(5, costs, 1.0) == 14.0 and ts.step_ms(3, costs, 1.0) == 12.0
    with pytest.raises(ValueError, match="too few"):
        ts.simulate(seqs[:1], [2], 0.5, costs, 2.0, 1.0)


def test_confidence_tree_takes_the_blocks_likeliest_nodes_in_tree_order_on_ties():
    tree = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    probs = [[0.5, 0.4], [0.9, 0.05]]
    # confidences: (0,) .5, (1,) .4, (0,0) .45, (0,1) .025, (1,0) .36
    assert ts.confidence_tree(tree, probs, 2) == {(0,), (0, 0)}
    assert ts.confidence_tree(tree, probs, 4) == {(0,), (0, 0), (1,), (1, 0)}
    tied = [[0.5, 0.5], [1.0, 0.0]]  # (1,) and (0, 0) tie with (0,): the tree's order
    assert ts.confidence_tree(tree, tied, 2) == {(0,), (1,)}


def test_calibration_counts_each_slot_where_the_chain_reached_it():
    ranks = [[[0, 0, 1], [0, 1, 0], [1, 0, 0]]]
    probs = [[[[0.95]] * 3, [[0.3], [0.7], [0.1]], [[0.5]] * 3]]
    rows = {(r["slot"], r["bin"]): r for r in ts.calibration(ranks, probs, slots=2)}
    assert rows[(1, "0.9-1.0")]["anchors"] == 1 and rows[(1, "0.9-1.0")]["accepted"] == 1.0
    assert rows[(1, "0.2-0.4")]["accepted"] == 1.0 and rows[(1, "0.4-0.6")]["accepted"] == 0.0
    # slot 2 only where slot 1 was accepted: anchors 1 (p .95, hit) and 2 (p .7, miss)
    assert rows[(2, "0.9-1.0")]["accepted"] == 1.0 and rows[(2, "0.6-0.8")]["accepted"] == 0.0
    assert sum(r["anchors"] for (slot, _), r in rows.items() if slot == 2) == 2


def test_confidence_rows_compare_the_same_tree_in_both_orders():
    # every block: rank 1 at slot 1 is the target's and the draft is sure of it, so the
    # confidence order takes (1,) first where the fitted tree's order starts with (0,)
    seqs = [[[0, 0, 0]] * 6 + [[1, 0, 0]] * 4, [[1, 0, 0]] * 10]
    probs = [[[[0.4, 0.6, 0.0]] * 3] * 10] * 2
    (row,) = ts.confidence_rows(seqs, probs, [1], 0.5, 32)
    assert row["fixed"] == 1.0 and row["confidence"] == 2.0
