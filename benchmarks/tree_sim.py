"""What verifying a tree of drafted tokens would buy over a chain: a simulation on stored answers.

A DFlash block pass scores every slot at once from MASK inputs, so besides its greedy chain it
offers, at each slot, a ranked list of alternatives that do not depend on what the slots
before it hold. A tree verified in one target pass (one query row per node, each seeing its
ancestors) accepts the longest path whose tokens match the target's. This script measures,
for every response position of stored sequences (``scripts/dflash_data.py`` folders: the
target's greedy answers with tapped features), the rank of the target's token at each slot
(``train_dflash.slot_ranks``), then walks each sequence as a server would (greedy, one
stream): a chain of K accepts the leading slots of rank 0; a tree, a set of rank paths such as
``(0,)``, ``(1,)``, ``(0, 0)``, accepts the deepest path that is a prefix of the target's
ranks. Trees of n nodes are built from the most frequent rank prefixes of the first half of
the sequences (``--fit-fraction``) and measured on the rest, as are the chains.

Speed against no speculation is ``acceptance * step(0) / (step(n) + draft)``, from one-row
step costs by verified rows (``replay_policy.STEP_MS``, measured; beyond its last entry each
row adds ``--row-ms``, an assumption). ``--write-tree`` writes the ``tree.json`` a draft
ships (``engine.spec.tree``: the engine verifies such trees).

    python benchmarks/tree_sim.py DATA_DIR [--draft DRAFT] [--nodes 2 4 8 16 32]
    python benchmarks/tree_sim.py DATA_DIR --val-split 200 --write-tree DRAFT/tree.json

``--confidence`` measures instead how well the draft's own probabilities predict acceptance
(per slot, by probability) and what ordering each block's tree by them buys
(``engine.spec.tree_order``): the first n nodes of a 32-node frequency tree in its order
against the n the block is most confident in.

    python benchmarks/tree_sim.py DATA_DIR --confidence --nodes 2 4 8 16 --limit 400
"""

from __future__ import annotations

import argparse
import bisect
import functools
import math
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmarks.replay_policy import DRAFT_MS, STEP_MS, load_draft  # noqa: E402

Path_ = tuple[int, ...]


def chain_accepts(ranks: list[int], k: int) -> int:
    """Drafted tokens a chain of ``k`` greedy slots gets accepted."""
    a = 0
    while a < k and ranks[a] == 0:
        a += 1
    return a


def tree_accepts(ranks: list[int], tree: set[Path_]) -> int:
    """Depth of the deepest tree path that matches the target's ranks."""
    a = 0
    while a < len(ranks) and tuple(ranks[: a + 1]) in tree:
        a += 1
    return a


def walk(seqs: list[list[list[int]]], accepts) -> float:
    """Served mean acceptance length (bonus token included): each sequence's walk starts at its
    first response token and moves by the accepted drafts plus one."""
    tokens = steps = 0
    for ranks in seqs:
        p = 0
        while p < len(ranks):
            gained = accepts(ranks[p]) + 1
            tokens, steps, p = tokens + gained, steps + 1, p + gained
    return tokens / max(1, steps)


def frequency_tree(seqs: list[list[list[int]]], nodes: int, max_rank: int = 8) -> list[Path_]:
    """The ``nodes`` rank paths that most often prefix the target's ranks, most frequent first
    (ties: shallower first, then lower ranks); every path comes after its parent, since a
    prefix is at least as frequent as the paths under it."""
    counts: Counter[Path_] = Counter()
    for ranks in seqs:
        for row in ranks:
            for d in range(1, len(row) + 1):
                if row[d - 1] >= max_rank:
                    break
                counts[tuple(row[:d])] += 1
    tree: list[Path_] = []
    for path, _ in sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0])):
        if len(tree) == nodes:
            break
        if len(path) == 1 or path[:-1] in tree:
            tree.append(path)
    return tree


def tree_file(seqs: list[list[list[int]]], nodes: int) -> dict:
    """``tree.json`` for a draft (``engine.spec.tree``): the ``nodes`` most frequent rank
    paths in order, and each node's acceptance when its parent is accepted, counted at the
    positions a one-stream walk verifying that tree visits (the served figure, not every
    position's: those overstate served acceptance)."""
    paths = frequency_tree(seqs, nodes)
    index = {p: i for i, p in enumerate(paths)}
    tree = set(paths)
    hits, trials = [0] * len(paths), [0] * len(paths)
    for ranks in seqs:
        p = 0
        while p < len(ranks):
            row = ranks[p]
            depth = tree_accepts(row, tree)
            for path, i in index.items():
                if tuple(row[: len(path) - 1]) == path[:-1]:  # its parent was accepted
                    trials[i] += 1
                    hits[i] += tuple(row[: len(path)]) == path
            p += depth + 1
    return {"paths": [list(p) for p in paths],
            "conditional": [round(h / t, 4) if t else 0.0 for h, t in zip(hits, trials)]}


def confidence_tree(tree: list[Path_], probs: list[list[float]], n: int) -> set[Path_]:
    """The ``n`` nodes of ``tree`` (paths in order, parents first) a block with slot
    probabilities ``probs`` (``[slot][rank]``) is most confident in, as the engine orders
    them (``engine.spec.tree_order.ConfidenceOrder``: by the product of their path's
    probabilities, ties in the tree's order)."""
    logp = [[math.log(v) if v > 0 else -math.inf for v in slot] for slot in probs]
    return {tree[j] for j in _confidence_order(tuple(tree)).order(logp, len(probs), n)[0]}


@functools.lru_cache(maxsize=8)
def _confidence_order(tree: tuple[Path_, ...]):
    """One engine ordering per tree, not per block (the walks ask for it at every anchor)."""
    from engine.spec.tree import DraftTree
    from engine.spec.tree_order import ConfidenceOrder

    return ConfidenceOrder(DraftTree.from_paths([list(p) for p in tree]))


def walk_blocks(seqs: list[list[list[int]]], probs: list[list[list[list[float]]]], accepts
                ) -> float:
    """:func:`walk` where ``accepts(ranks, probs)`` also sees the block's slot probabilities."""
    tokens = steps = 0
    for ranks, block in zip(seqs, probs):
        p = 0
        while p < len(ranks):
            gained = accepts(ranks[p], block[p]) + 1
            tokens, steps, p = tokens + gained, steps + 1, p + gained
    return tokens / max(1, steps)


def calibration(seqs: list[list[list[int]]], probs: list[list[list[list[float]]]],
                slots: int = 3, edges: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
                ) -> list[dict]:
    """How often slot ``d``'s best token is the target's, given that slots ``1..d-1`` were
    (a chain walked that far), by the draft's probability of it: one row per slot and
    probability bin, every anchor counted."""
    counts = [[[0, 0] for _ in edges[:-1]] for _ in range(slots)]
    for ranks, block in zip(seqs, probs):
        for row, ps in zip(ranks, block):
            for d in range(min(slots, len(row))):
                b = min(len(edges) - 2, max(0, bisect.bisect_right(edges, ps[d][0]) - 1))
                counts[d][b][0] += row[d] == 0
                counts[d][b][1] += 1
                if row[d] != 0:
                    break
    return [{"slot": d + 1, "bin": f"{lo:.1f}-{hi:.1f}", "anchors": n,
             "accepted": hit / n if n else float("nan")}
            for d in range(slots)
            for (lo, hi), (hit, n) in zip(zip(edges, edges[1:]), counts[d])]


def step_ms(rows: int, costs: list[float], row_ms: float) -> float:
    return costs[rows] if rows < len(costs) else costs[-1] + row_ms * (rows - len(costs) + 1)


def simulate(seqs: list[list[list[int]]], nodes: list[int], fit_fraction: float,
             costs: list[float], draft_ms: float, row_ms: float) -> list[dict]:
    cut = int(len(seqs) * fit_fraction)
    fit, held = seqs[:cut], seqs[cut:]
    if not fit or not held:
        raise ValueError(f"{len(seqs)} sequences: too few to fit on {fit_fraction:.0%} and "
                         "measure on the rest")
    block = len(held[0][0])
    rows = []
    for k in range(1, block + 1):
        rows.append({"kind": f"chain K={k}", "rows": k,
                     "accept": walk(held, lambda r, k=k: chain_accepts(r, k))})
    for n in nodes:
        tree = set(frequency_tree(fit, n))
        rows.append({"kind": f"tree, {n} nodes, depth {max(map(len, tree))}", "rows": n,
                     "accept": walk(held, lambda r, t=tree: tree_accepts(r, t))})
    for r in rows:
        r["speed"] = r["accept"] * costs[0] / (step_ms(r["rows"], costs, row_ms) + draft_ms)
    return rows


def measure_ranks(data: Path, draft_dir: Path, model: str, taps: list[int],
                  val_split: int = 0, width: int = 0, limit: int | None = None) -> list:
    """Per sequence, its slot ranks (``train_dflash.slot_ranks``); with ``width``, the pair
    (ranks, each slot's ``width`` largest probabilities)."""
    import torch
    import train_dflash as td

    draft, frozen = load_draft(draft_dir, model)
    seqs = td.load_sequences(data, taps)
    if val_split:
        seqs = td.split_sequences(seqs, val_split, 0)[0]
    out = []
    with torch.no_grad():
        for seq in seqs[:limit]:
            got = td.slot_ranks(draft, frozen, seq, width=width)
            out.append((got[0].tolist(), got[1].tolist()) if width else got.tolist())
    return out


def confidence_rows(seqs: list[list[list[int]]], probs: list[list[list[list[float]]]],
                    nodes: list[int], fit_fraction: float, tree_nodes: int) -> list[dict]:
    """Acceptance of the first ``n`` nodes of a ``tree_nodes``-node frequency tree (fitted on
    the first ``fit_fraction`` of the sequences, measured on the rest) in the tree's order
    and in each block's confidence order."""
    cut = int(len(seqs) * fit_fraction)
    tree = frequency_tree(seqs[:cut], tree_nodes)
    held, held_probs = seqs[cut:], probs[cut:]
    rows = []
    for n in nodes:
        if n > len(tree):
            break
        fixed = set(tree[:n])
        rows.append({"nodes": n, "fixed": walk(held, lambda r, t=fixed: tree_accepts(r, t)),
                     "confidence": walk_blocks(held, held_probs, lambda r, p, n=n: tree_accepts(
                         r, confidence_tree(tree, p, n)))})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", type=Path, help="draft-data folder with features")
    p.add_argument("--draft", type=Path, default=ROOT / "models" / "drafts" / "smollm2-135m-instruct-dflash")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--taps", type=int, nargs="+", default=[1, 14, 27])
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64])
    p.add_argument("--fit-fraction", type=float, default=0.5)
    p.add_argument("--step-ms", type=float, nargs="+", default=STEP_MS,
                   help="one-row step ms verifying 0, 1, 2, ... drafted tokens")
    p.add_argument("--draft-ms", type=float, default=DRAFT_MS)
    p.add_argument("--row-ms", type=float, default=STEP_MS[-1] - STEP_MS[-2],
                   help="ms each verified row adds past the last --step-ms entry (assumed)")
    p.add_argument("--val-split", type=int, default=0,
                   help="use only the validation sequences train_dflash.py draws from this "
                        "folder (--val-sequences N, --seed 0): data the draft never trained on")
    p.add_argument("--write-tree", type=Path, default=None,
                   help="write tree.json (--tree-nodes paths fitted on all the sequences) here")
    p.add_argument("--tree-nodes", type=int, default=8)
    p.add_argument("--confidence", action="store_true",
                   help="instead: how the draft's own slot probabilities predict acceptance, "
                        "and the first --nodes of a 32-node tree in its order against each "
                        "block's confidence order (engine.spec.tree_order)")
    p.add_argument("--limit", type=int, default=None, help="the first N sequences only")
    args = p.parse_args(argv)
    if args.confidence:
        both = [s for s in measure_ranks(args.data, args.draft, args.model, args.taps,
                                         args.val_split, width=8, limit=args.limit) if s[0]]
        seqs, probs = [s[0] for s in both], [s[1] for s in both]
        print(f"{args.data}: {len(seqs)} sequences, {sum(map(len, seqs))} anchors")
        print("| slot | draft's probability of its best token | anchors | accepted |")
        print("|---|---|---|---|")
        for r in calibration(seqs, probs):
            print(f"| {r['slot']} | {r['bin']} | {r['anchors']} | {r['accepted']:.2f} |")
        rows = confidence_rows(seqs, probs, args.nodes, args.fit_fraction, 32)
        print(f"\nfirst n nodes of a 32-node tree fitted on {int(len(seqs) * args.fit_fraction)}"
              " sequences, walked on the rest")
        print("| nodes verified | tree's order | each block's confidence order |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['nodes']} | {r['fixed']:.3f} | {r['confidence']:.3f} |")
        return
    seqs = [s for s in measure_ranks(args.data, args.draft, args.model, args.taps,
                                     args.val_split, limit=args.limit) if s]
    if args.write_tree is not None:
        import json

        data = tree_file(seqs, args.tree_nodes)
        args.write_tree.write_text(json.dumps(data) + "\n")
        print(f"wrote {args.write_tree}: {data}")
    rows = simulate(seqs, args.nodes, args.fit_fraction, args.step_ms, args.draft_ms, args.row_ms)
    cut = int(len(seqs) * args.fit_fraction)
    print(f"{args.data}: trees fitted on {cut} sequences, measured on {len(seqs) - cut}")
    print("| drafted tokens verified | rows | mean acceptance length | speed vs none |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['rows']} | {r['accept']:.3f} | {r['speed']:.2f}x |")


if __name__ == "__main__":
    main()
