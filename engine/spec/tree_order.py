"""A tree's nodes in the order of one block's confidence in them (``DraftTree.dynamic``).

A DFlash block gives, at every slot, a probability for each candidate token; a node's
*confidence* is the product of its path's probabilities (the block's own chance that the
node's tokens are the target's). These probabilities are close to calibrated: on 67,189
anchors of a piece of self-written chat, self-instruct and GSM8K answers the shipped draft never
trained on, a first slot whose best token had probability 0-0.2 was accepted 13% of the time,
0.4-0.6 48%, above 0.9 96%, and the second and third slots (where the chain reached them)
alike (``benchmarks/tree_sim.py --confidence``; ``docs/draft_data.md``, "Twenty-third step").
So where a fixed order verifies the nodes most often accepted on average, this one verifies,
block by block, the nodes most likely accepted in this block: in a simulated one-stream walk
of those answers, the first 4 nodes of a 32-node tree so ordered were accepted 2.14 tokens a
step against 2.05 in the tree's order, the first 8 2.37 against 2.25 (programming requests:
2.02 against 1.93, 2.22 against 2.08).

A node's confidence never exceeds its parent's, and ties keep the fixed order (parents come
first in it), so every prefix of the new order is a tree: "verify ``k`` drafts" keeps its
meaning. Served (``speculative_config.tree_order``, "confidence" by default): the proposer
makes every node of the slots it scores, in this order, and hands each request a
``DraftWindow`` (the nodes' parents and confidences); the controller verifies the leading
drafts their confidence says pay (scaled by what verification has accepted,
``engine.spec.acceptance.ConfidenceScale``), and chooses how many to make from the acceptance
model as before.
"""

from __future__ import annotations

import math

from engine.spec.tree import DraftTree, DraftWindow


class ConfidenceOrder:
    """Orders one tree's nodes for blocks of slot log-probabilities, on the host: a block's
    few dozen nodes cost tens of microseconds in Python, where the same as tensor operations
    (a dozen small ones per step) took 0.25-0.44 ms more (one request, 2-vCPU EPYC)."""

    def __init__(self, tree: DraftTree) -> None:
        self.width = tree.max_rank + 1  # candidates scored per slot
        self.num_nodes = tree.num_nodes
        # per node, in the tree's order (parents first): slot (0-based), rank, parent node
        # (0-based, -1: the root)
        self._nodes = [(d - 1, r, p - 1) for d, r, p in zip(tree.depths, tree.ranks, tree.parents)]
        # within[s]: the nodes a block of s scored slots holds (their depth at most s)
        self.within = [sum(d <= s for d in tree.depths) for s in range(tree.max_depth + 1)]

    def order(self, logp: list[list[float]], rows: int, count: int
              ) -> tuple[list[int], DraftWindow, list[tuple[int, int]]]:
        """For one block whose scored slots are ``logp`` (``rows`` of them, each slot's
        candidates' log-probabilities, best first): its ``count`` most confident nodes (0-based
        node indices; nodes deeper than its slots come last, ties in the tree's order), their
        window (each one's parent as a window row, 0: the root, row ``k`` the ``k``-th node
        kept; and its confidence) and each one's ``(slot, rank)``, where its token is."""
        conf: list[float] = []
        for slot, rank, parent in self._nodes:
            if slot >= rows:
                conf.append(-math.inf)
            else:  # a child adds a log-probability <= 0: it never rounds above its parent
                conf.append(logp[slot][rank] + (conf[parent] if parent >= 0 else 0.0))
        # (a stable sort: reversed, equal nodes keep the tree's order, so a parent comes
        # before a child as confident as itself)
        kept = sorted(range(self.num_nodes), key=conf.__getitem__, reverse=True)[:count]
        row = {node: k for k, node in enumerate(kept, start=1)}
        nodes = self._nodes
        parents = [row[nodes[j][2]] if nodes[j][2] >= 0 else 0 for j in kept]
        window = DraftWindow(parents, [math.exp(conf[j]) for j in kept])
        return kept, window, [(nodes[j][0], nodes[j][1]) for j in kept]
