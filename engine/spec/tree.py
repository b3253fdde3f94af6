"""A tree of drafted tokens: which alternatives of a DFlash block are verified, in what order.

A DFlash block scores every slot at once, so its candidates at slot ``d`` do not depend on the
tokens chosen at slots ``1..d-1``. A node of the tree is a *rank path* ``(r_1, ..., r_d)``: the
``r_1``-th best token of slot 1, then the ``r_2``-th best of slot 2, and so on; its token is the
``r_d``-th best of slot ``d`` and its parent is the path without its last rank. A chain of
``K`` drafts is the tree of the all-zero paths of length ``1..K``.

Nodes are kept in one fixed order in which every node comes after its parent (a draft's own
tree: by each node's measured chance of acceptance, the product of its path's ``conditional``,
most likely first; an explicit tree: as given), so the first
``k`` nodes always form a tree themselves and "verify ``k`` drafts" keeps its meaning: the
controller picks ``k``, the scheduler takes the first ``k`` nodes (by default each block
reorders them by its own confidence, ``engine.spec.tree_order``; any prefix is still a tree,
laid out from the block's ``DraftWindow``). Node ``j`` (1-based) is row
``j`` of a verify window whose row 0 is the root (the request's newest token); it sits at
position ``root + depth(j)`` and sees its ancestors and itself (the attention tree mask).

A draft may ship ``tree.json`` beside its weights: ``{"paths": [[0], [0, 0], [1], ...],
"conditional": [...]}``, the paths in order and, optionally, each node's measured chance of
being accepted when its parent is (the acceptance model's seed).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("specserve.spec")

TREE_FILE = "tree.json"
MAX_TREE_NODES = 62  # a verify window (root + nodes) fits the 63 bits of an int64 mask


class TreeError(ValueError):
    """An invalid tree of rank paths; the message says which path and why."""


@dataclass(frozen=True)
class DraftTree:
    paths: tuple[tuple[int, ...], ...]  # node j (1-based) is paths[j - 1]
    parents: tuple[int, ...]  # parents[j - 1]: node j's parent (0: the root)
    depths: tuple[int, ...]  # depths[j - 1]: node j's slot in the draft block (1-based)
    ranks: tuple[int, ...]  # ranks[j - 1]: node j's rank among its slot's candidates
    conditional: tuple[float, ...] | None = None  # measured P(node | parent accepted)
    # each block's nodes are verified in the order of the draft's own confidence in them
    # (engine.spec.tree_order), not in this fixed order
    dynamic: bool = False
    # peaks[j]: the deepest of nodes 1..j+1 (non-decreasing), so the leading nodes within a
    # depth are a bisection; the scheduler asks for every sampling request every step
    peaks: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peaks", tuple(itertools.accumulate(self.depths, max)))

    @classmethod
    def from_paths(cls, paths, conditional=None) -> DraftTree:
        if not isinstance(paths, (list, tuple)):
            raise TreeError(f"a tree is a list of rank paths such as [[0], [0, 0], [1]], "
                            f"got {paths!r}")
        seen: dict[tuple[int, ...], int] = {(): 0}
        parents, norm = [], []
        for i, raw in enumerate(paths):
            if not isinstance(raw, (list, tuple)) or not raw or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in raw):
                raise TreeError(f"tree path {i} ({raw!r}) must be a non-empty list of ranks >= 0")
            path = tuple(raw)
            if path in seen:
                raise TreeError(f"tree path {i} ({list(path)}) appears twice")
            if path[:-1] not in seen:
                raise TreeError(f"tree path {i} ({list(path)}) comes before its parent "
                                f"{list(path[:-1])}; every path's prefix must come first")
            parents.append(seen[path[:-1]])
            seen[path] = i + 1
            norm.append(path)
        if not norm:
            raise TreeError("a tree needs at least one path")
        if len(norm) > MAX_TREE_NODES:
            raise TreeError(f"a tree has at most {MAX_TREE_NODES} nodes, got {len(norm)}")
        cond = None
        if conditional is not None:
            if len(conditional) != len(norm) or not all(
                    isinstance(c, (int, float)) and 0 <= c <= 1 for c in conditional):
                raise TreeError("tree 'conditional' must list one number in [0, 1] per path")
            cond = tuple(float(c) for c in conditional)
        return cls(tuple(norm), tuple(parents), tuple(len(p) for p in norm),
                   tuple(p[-1] for p in norm), cond)

    @classmethod
    def chain(cls, k: int) -> DraftTree:
        return cls.from_paths([[0] * d for d in range(1, k + 1)])

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def is_chain(self) -> bool:
        return all(p == j for j, p in enumerate(self.parents))

    def truncated(self, max_depth: int) -> DraftTree | None:
        """The nodes of depth at most ``max_depth``, their order kept (``None``: none)."""
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        if not keep:
            return None
        cond = None if self.conditional is None else [self.conditional[i] for i in keep]
        return DraftTree.from_paths([self.paths[i] for i in keep], cond)

    def reaches(self) -> tuple[float, ...] | None:
        """Each node's chance of acceptance (the product of ``conditional`` along its path),
        or ``None`` without a measured ``conditional``."""
        if self.conditional is None:
            return None
        out: list[float] = []
        for p, c in zip(self.parents, self.conditional):
            out.append(c * (out[p - 1] if p else 1.0))
        return tuple(out)

    def by_reach(self) -> DraftTree:
        """The same nodes, most likely accepted first (by :meth:`reaches`; ties keep their
        order), so that the first ``k`` nodes are the ``k`` worth most. A child never reaches
        more than its parent, so parents still come first. Unchanged without ``conditional``."""
        reach = self.reaches()
        if reach is None:
            return self
        order = sorted(range(self.num_nodes), key=lambda i: -reach[i])
        assert self.conditional is not None
        return DraftTree.from_paths([self.paths[i] for i in order],
                                    [self.conditional[i] for i in order])

    def nodes_within(self, max_depth: int, max_nodes: int) -> int:
        """How many leading nodes fit ``max_depth`` accepted tokens and ``max_nodes`` rows."""
        return max(0, min(max_nodes, bisect.bisect_right(self.peaks, max_depth)))

    def window_parents(self, k: int) -> list[int] | None:
        """Parents of a window's first ``k`` nodes; ``None`` when they form a chain."""
        return _unless_chain(list(self.parents[:k]))


@dataclass
class DraftWindow:
    """Drafts laid out as a tree of their own block's (``engine.spec.tree_order``)."""

    parents: list[int]  # parents[j - 1]: draft j's parent row (0: the root)
    confidence: list[float]  # the block's own chance that draft j is accepted (non-increasing)
    # peaks[j]: the deepest of drafts 1..j+1 (as DraftTree.peaks; read twice a step)
    peaks: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.peaks = list(itertools.accumulate(window_depths(self.parents)[1:], max))

    def nodes_within(self, num_drafts: int, max_depth: int, max_nodes: int) -> int:
        """How many of the leading ``num_drafts`` drafts (those held) fit ``max_depth``
        accepted tokens and ``max_nodes`` rows."""
        fit = bisect.bisect_right(self.peaks, max_depth, hi=min(num_drafts, len(self.peaks)))
        return max(0, min(max_nodes, fit))

    def window_parents(self, k: int) -> list[int] | None:
        """Parents of the first ``k`` drafts; ``None`` when they form a chain."""
        return _unless_chain(self.parents[:k])


def _unless_chain(parents: list[int]) -> list[int] | None:
    return None if all(p == j for j, p in enumerate(parents)) else parents


def slots_needed(tree: DraftTree | None, num_drafts: int) -> tuple[int, ...]:
    """``out[n]``: the draft block slots (1-based, the first ``out[n]``) that the first ``n``
    drafts occupy, for ``n = 0 .. num_drafts``: ``n`` for a chain, the deepest of its first
    ``n`` nodes for a tree (what proposing them costs the proposer, and the cost model); for a
    tree ordered per block (``dynamic``), whose first ``n`` nodes may be a chain, ``n`` up to
    the tree's depth."""
    if tree is None:
        return tuple(range(num_drafts + 1))
    if tree.dynamic:
        return tuple(min(n, tree.max_depth) for n in range(num_drafts + 1))
    return (0, *tree.peaks[:num_drafts])


def window_depths(parents: list[int]) -> list[int]:
    """Depth of every row of a verify window (row 0: the root) from its nodes' parents."""
    depths = [0]
    for p in parents:
        depths.append(depths[p] + 1)
    return depths


def window_masks(parents: list[int], first: int = 0) -> list[int]:
    """Attention tree masks of a window's rows: bit ``first + i`` for row ``i`` and each of
    its ancestors (``first``: the root's offset in its request's query block, whose earlier
    offsets every row sees)."""
    masks = [(1 << (first + 1)) - 1]
    for j, p in enumerate(parents, start=1):
        masks.append(masks[p] | (1 << (first + j)))
    return masks


def accepted_path(parents: list[int] | None, drafts: list[int], targets: list[int]
                  ) -> list[int]:
    """Nodes (1-based rows) accepted by a verify window: from the root, the child whose draft
    equals the target's token at its parent's row, while there is one. ``targets[i]``: the
    token the target chose at row ``i``. For a chain: rows ``1..n`` while they match."""
    path: list[int] = []
    row = 0
    if parents is None:
        while row < len(drafts) and drafts[row] == targets[row]:
            row += 1
            path.append(row)
        return path
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parents, start=1):
        children.setdefault(p, []).append(j)
    while True:
        nxt = next((j for j in children.get(row, ()) if drafts[j - 1] == targets[row]), None)
        if nxt is None:
            return path
        path.append(nxt)
        row = nxt


def unsupported(attention_backend: str) -> str | None:
    """Why trees cannot be verified with this engine shape (``None``: they can)."""
    if attention_backend.strip().lower() == "flashinfer":
        return "the flashinfer backend has no tree masks yet"
    return None


def load_tree(spec_tree, draft_dir: str | None, k: int, why_not: str | None = None,
              dynamic: bool = False) -> DraftTree | None:
    """The tree a speculative config asks for, cut to depth ``k``; ``None`` for a chain.

    ``spec_tree``: ``None`` (the draft's ``tree.json`` if it ships one, else a chain),
    ``"chain"``, a list of rank paths, or a tree.json's content (``{"paths": ...,
    "conditional": ...}``). An explicit tree keeps its order; the draft's own is put in the
    order of its measured reach (:meth:`DraftTree.by_reach`). ``why_not``: why this engine
    cannot verify trees (:func:`unsupported`): an explicit tree is then an error, a draft's
    own one is skipped. ``dynamic``: each block's nodes are verified most confident first
    (:attr:`DraftTree.dynamic`)."""
    if spec_tree == "chain":
        return None
    if spec_tree is not None and why_not is not None:
        raise TreeError(f"verifying a tree of drafts is not supported here ({why_not}); "
                        'set "tree": "chain"')
    if spec_tree is None:
        path = Path(draft_dir).expanduser() / TREE_FILE if draft_dir else None
        if path is None or not path.is_file():
            return None
        if why_not is not None:
            log.info("not verifying the draft's %s (%s): chains", TREE_FILE, why_not)
            return None
        try:
            tree = tree_from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s (%s): verifying chains", path, exc)
            return None
        cut = tree.truncated(k)
        tree = None if cut is None else cut.by_reach()
    else:
        tree = tree_from_json(spec_tree).truncated(k)
    if tree is None or tree.is_chain:
        return None
    return dataclasses.replace(tree, dynamic=True) if dynamic else tree


def tree_from_json(value) -> DraftTree:
    """A tree from a list of rank paths or a tree.json's content (``paths`` and, optionally,
    ``conditional``)."""
    if isinstance(value, dict):
        if "paths" not in value or set(value) - {"paths", "conditional"}:
            raise TreeError(f"a tree object has 'paths' and optionally 'conditional', got keys "
                            f"{sorted(value)}")
        return DraftTree.from_paths(value["paths"], value.get("conditional"))
    return DraftTree.from_paths(value)
