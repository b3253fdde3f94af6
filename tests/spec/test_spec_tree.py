"""Trees of drafts (engine.spec.tree): the shape, its acceptance bookkeeping, the sampler's walk,
and end to end: outputs equal plain decoding's, token for token, whichever branch is accepted."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from engine import SamplingParams
from engine.config import ConfigError, SpeculativeConfig
from engine.request import Request
from engine.sampler import RowGroup, Sampler
from engine.spec.acceptance import AcceptanceModel, expected_gains
from engine.spec.policy import acceptance_parents, tree_seed
from engine.spec.tree import (
    DraftTree,
    DraftWindow,
    TreeError,
    accepted_path,
    load_tree,
    window_depths,
    window_masks,
)
from engine.spec.tree_order import ConfidenceOrder

from .helpers import assert_same_tokens, greedy, make_llm, random_prompts, token_ids

PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]


# -- the shape -----------------------------------------------------------------------------------

def test_tree_from_paths():
    t = DraftTree.from_paths(PATHS)
    assert t.parents == (0, 0, 1, 1, 2, 3, 0)
    assert t.depths == (1, 1, 2, 2, 2, 3, 1)
    assert t.ranks == (0, 1, 0, 1, 0, 0, 2)
    assert (t.num_nodes, t.max_depth, t.max_rank, t.is_chain) == (7, 3, 2, False)
    assert DraftTree.chain(3).is_chain and DraftTree.chain(3).parents == (0, 1, 2)
    cut = t.truncated(2)
    assert cut.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (2,))
    assert t.truncated(0) is None
    # leading nodes within 2 accepted tokens and 4 rows; within 1 token: the first two only
    assert t.nodes_within(2, 4) == 4 and t.nodes_within(1, 10) == 2
    assert t.window_parents(1) is None and t.window_parents(3) == [0, 0, 1]


def test_nodes_within_is_the_leading_walk():
    """The lookup the scheduler uses equals walking the leading nodes while they fit, for
    random trees and every depth and row limit (including none and past the tree)."""
    rng = random.Random(3)

    def walk(t: DraftTree, depth: int, rows: int) -> int:
        k = 0
        while k < min(rows, t.num_nodes) and t.depths[k] <= depth:
            k += 1
        return k

    trees = [DraftTree.from_paths(PATHS), DraftTree.chain(5)]
    for _ in range(20):
        paths: list[list[int]] = []
        size = rng.randint(1, 30)
        while len(paths) < size:
            parent = rng.choice([[]] + paths)
            child = parent + [rng.randint(0, 3)]
            if child not in paths:
                paths.append(child)
        trees.append(DraftTree.from_paths(paths))
    for t in trees:
        for depth in range(-1, t.max_depth + 3):
            for rows in range(-1, t.num_nodes + 3):
                assert t.nodes_within(depth, rows) == walk(t, depth, rows), (t.paths, depth, rows)


@pytest.mark.parametrize("paths,match", [
    ([[0, 0], [0]], "before its parent"),
    ([[0], [0]], "twice"),
    ([[0], []], "non-empty"),
    ([[0], [-1]], "ranks >= 0"),
    ("[[0]]", "list of rank paths"),
    ([], "at least one"),
])
def test_tree_rejects_bad_paths(paths, match):
    with pytest.raises(TreeError, match=match):
        DraftTree.from_paths(paths)


def test_window_layout():
    parents = [0, 0, 1, 1, 2]
    assert window_depths(parents) == [0, 1, 1, 2, 2, 2]
    masks = window_masks(parents)
    assert masks == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    # a root after two known tokens in the query block: every row also sees them
    assert window_masks([0], first=2) == [0b111, 0b1111]


def test_accepted_path_walks_matching_children():
    parents = [0, 0, 1, 1, 2]  # rows 1,2 under the root; 3,4 under 1; 5 under 2
    drafts = [10, 11, 20, 21, 22]
    # the target picks 11 at the root (row 2), then 22 at row 2 (row 5), then anything
    assert accepted_path(parents, drafts, [11, 0, 22, 0, 0, 7]) == [2, 5]
    assert accepted_path(parents, drafts, [10, 21, 0, 0, 0, 0]) == [1, 4]
    assert accepted_path(parents, drafts, [9, 0, 0, 0, 0, 0]) == []
    assert accepted_path(None, [5, 6, 7], [5, 6, 8, 0]) == [1, 2]


# -- acceptance bookkeeping ------------------------------------------------------------------------

def test_tree_gains_follow_paths_and_never_increase():
    parents = (0, 0, 1, 2)
    g = expected_gains([0.5, 0.2, 0.6, 0.9], parents)
    assert g == pytest.approx([0.5, 0.2, 0.2, 0.18])  # node 3: 0.5 * 0.6 = 0.3, held to 0.2
    assert expected_gains([0.5, 0.5]) == [0.5, 0.25]


def test_tree_acceptance_counts_tried_nodes_only():
    model = AcceptanceModel(4, [0.5] * 4, parents=(0, 0, 1, 2))
    state = model.new_request()
    model.observe(state, 4, 2, path=[2, 4])  # root -> node 2 -> node 4
    # node 1 tried and missed, node 2 hit, node 3 untried (its parent 1 was rejected), node 4 hit
    assert state.trials == [1.0, 1.0, 0.0, 1.0]
    assert state.hits == [0.0, 1.0, 0.0, 1.0]
    model.observe(state, 2, 0, path=[])
    # untried nodes keep their counts (as positions past a chain's rejection do)
    assert state.trials == [pytest.approx(1.85), pytest.approx(1.85), 0.0, 1.0]


# -- the sampler's walk ----------------------------------------------------------------------------

def _logits(rows: list[int], vocab: int = 16) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        out[i, t] = 5.0
    return out


def test_sampler_greedy_tree_walk_and_logprobs():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, logprobs=1))
    parents = [0, 0, 1, 2]
    drafts = [4, 5, 6, 7]
    # argmax per row: root -> 5 (row 2), row 2 -> 7 (row 4), row 4 -> 9 (emitted)
    logits = _logits([5, 0, 7, 0, 9])
    res = Sampler()(logits, [RowGroup(req, 0, drafts, parents)])["r"]
    assert res.tokens == [5, 7, 9] and res.num_accepted == 2 and res.path == [2, 4]
    assert [lp.token_id for lp in res.logprobs] == [5, 7, 9]


def test_sampler_tree_rows_of_one_depth_share_a_seeded_draw():
    """Seeded sampling: row r of a tree uses draw depth(r), so siblings sample the same
    uniform and the generator ends as if one token per accepted depth had been drawn."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    parents = [0, 0, 1, 1]  # depths 0, 1, 1, 2, 2
    flat = torch.zeros(5, 16)  # every row the same uniform distribution
    req = Request("r", [1], params)
    res = Sampler()(flat, [RowGroup(req, 0, [99, 98, 97, 96], parents)])["r"]
    assert res.num_accepted == 0  # drafts are out of the distribution's reach: none accepted
    plain = Request("p", [1], params)
    g = plain.sampling_generator(torch.device("cpu"))
    want = int(torch.floor(torch.rand(1, generator=g, dtype=torch.float64) * 16))
    assert res.tokens == [want]
    # both generators are now one draw in
    assert torch.equal(req.generator.get_state(), g.get_state())


def test_by_reach_puts_the_likeliest_nodes_first():
    """Random trees and conditionals: the reordered tree holds the same nodes with the same
    conditionals, every parent before its children, reaches never increasing, ties in their
    old order; without a conditional the tree is unchanged."""
    rng = random.Random(11)
    for _ in range(200):
        paths: list[list[int]] = []
        while len(paths) < rng.randint(1, 20):
            parent = rng.choice([[]] + paths)
            child = parent + [rng.randint(0, 3)]
            if child not in paths:
                paths.append(child)
        cond = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in paths]
        t = DraftTree.from_paths(paths, cond)
        r = t.by_reach()  # from_paths checks that every parent comes first
        assert dict(zip(r.paths, r.conditional)) == dict(zip(t.paths, t.conditional))
        reach = r.reaches()
        assert all(a >= b for a, b in zip(reach, reach[1:]))
        old = {p: i for i, p in enumerate(t.paths)}
        for i in range(1, r.num_nodes):
            if reach[i - 1] == reach[i]:
                assert old[r.paths[i - 1]] < old[r.paths[i]]
    plain = DraftTree.from_paths(PATHS)
    assert plain.by_reach() is plain and plain.reaches() is None


def _random_tree(rng: random.Random, max_nodes: int = 20, max_rank: int = 3) -> DraftTree:
    paths: list[list[int]] = []
    while len(paths) < rng.randint(1, max_nodes):
        parent = rng.choice([[]] + paths)
        child = parent + [rng.randint(0, max_rank)]
        if child not in paths:
            paths.append(child)
    return DraftTree.from_paths(paths)


def test_confidence_order_is_each_blocks_likeliest_first():
    """Random trees and blocks of slot probabilities (some exactly 1, some tied): the nodes
    kept are the most confident first (the product of their path's probabilities, computed
    here node by node), ties in the tree's order, nodes past the block's slots last; every
    prefix is a tree (a parent's row comes before its child's), and the window parents and
    cells are those of the nodes kept."""
    rng = random.Random(5)
    for _ in range(300):
        tree = _random_tree(rng)
        order = ConfidenceOrder(tree)
        rows = rng.randint(1, tree.max_depth)
        probs = [[rng.choice([1.0, 0.5, 0.25, rng.random() + 1e-9]) for _ in range(order.width)]
                 for _ in range(rows)]
        count = rng.randint(1, tree.num_nodes)
        kept, window, cells = order.order([[math.log(v) for v in row] for row in probs],
                                          rows, count)
        parents = window.parents

        def conf(j):
            out = 1.0
            for d, r in enumerate(tree.paths[j]):
                if d >= rows:
                    return -1.0  # past the block's slots
                out *= probs[d][r]
            return out

        want = sorted(range(tree.num_nodes), key=lambda j: (-conf(j), j))[:count]
        assert [round(conf(j), 9) for j in kept] == [round(conf(j), 9) for j in want]
        assert window.confidence == pytest.approx([max(0.0, conf(j)) for j in kept])
        assert len(set(kept)) == count
        row_of = {node: k for k, node in enumerate(kept, start=1)}
        for k, node in enumerate(kept, start=1):
            p = tree.parents[node]
            assert parents[k - 1] == (row_of[p - 1] if p else 0) < k  # the parent is kept, before
            assert cells[k - 1] == (tree.depths[node] - 1, tree.ranks[node])


def test_window_nodes_within_counts_a_windows_leading_nodes():
    window = DraftWindow([0, 0, 1, 3, 2], [0.5] * 5)  # depths 1, 1, 2, 3, 2
    assert window.nodes_within(5, 1, 10) == 2
    assert window.nodes_within(5, 2, 10) == 3
    assert window.nodes_within(5, 3, 10) == 5
    assert window.nodes_within(5, 3, 4) == 4
    assert window.nodes_within(2, 3, 10) == 2  # the drafts held, not the window's
    assert window.nodes_within(4, 2, 10) == 3
    assert window.window_parents(5) == [0, 0, 1, 3, 2] and window.window_parents(1) is None
    assert DraftWindow([0, 1, 2], [0.5] * 3).window_parents(3) is None  # a chain


def test_acceptance_of_a_tree_ordered_per_block_counts_each_drafts_own_chance():
    """Ordered per block, draft j's parent changes from block to block: the acceptance model
    counts each draft as hung from the root (its own chance of acceptance), seeded with the
    fixed tree's reaches, so its gains are those rates; a fixed tree keeps its parents."""
    tree = DraftTree.from_paths([[0], [0, 0], [1]], [0.5, 0.6, 0.2])
    dynamic = dataclasses.replace(tree, dynamic=True)
    assert acceptance_parents(tree) == (0, 1, 0) and acceptance_parents(None) is None
    assert acceptance_parents(dynamic) == (0, 0, 0)
    assert tree_seed(tree, None) == [0.5, 0.6, 0.2]
    assert tree_seed(dynamic, None) == pytest.approx([0.5, 0.3, 0.2])
    model = AcceptanceModel(3, tree_seed(dynamic, None), parents=acceptance_parents(dynamic))
    assert model.gains(None) == pytest.approx([0.5, 0.3, 0.2])
    state = model.new_request()
    model.observe(state, 3, 1, [2])  # this block's second draft (say [1]) was accepted
    assert state.trials == [1.0, 1.0, 1.0] and state.hits == [0.0, 1.0, 0.0]


def test_draft_tree_in_reach_order_gets_uncapped_gains(tmp_path):
    """The draft's own tree is verified most likely node first, so the controller's gains
    (held non-increasing in node order) are the nodes' own chances; an explicit tree, paths
    or a tree.json's content, keeps its order and has the later node's gain capped."""
    import json

    file = {"paths": [[0], [0, 0], [0, 0, 0], [1]], "conditional": [0.5, 0.5, 0.5, 0.4]}
    (tmp_path / "tree.json").write_text(json.dumps(file))
    own = load_tree(None, str(tmp_path), 7)
    assert own.paths == ((0,), (1,), (0, 0), (0, 0, 0))
    assert expected_gains(list(own.conditional), own.parents) == list(own.reaches()) \
        == [0.5, 0.4, 0.25, 0.125]
    given = load_tree(file, None, 7)
    assert given.paths == ((0,), (0, 0), (0, 0, 0), (1,))
    assert expected_gains(list(given.conditional), given.parents) == [0.5, 0.25, 0.125, 0.125]
    assert load_tree(file["paths"], None, 7).conditional is None
    with pytest.raises(TreeError, match="optionally 'conditional'"):
        load_tree({"paths": [[0], [1]], "weights": [1, 1]}, None, 7)


# -- configuration ----------------------------------------------------------------------------------

def test_config_validates_trees():
    ok = SpeculativeConfig.parse({"method": "dflash", "model": "x", "tree": PATHS})
    assert ok.tree == PATHS
    assert SpeculativeConfig.parse({"method": "ngram", "tree": "chain"}).tree == "chain"
    with pytest.raises(ConfigError, match="needs method 'dflash'"):
        SpeculativeConfig.parse({"method": "ngram", "tree": PATHS})
    with pytest.raises(ConfigError, match="before its parent") as err:
        SpeculativeConfig.parse({"method": "dflash", "model": "x", "tree": [[0, 0]]})
    assert err.value.param == "speculative_config.tree"
    obj = {"paths": PATHS, "conditional": [0.5] * 7}
    assert SpeculativeConfig.parse({"method": "dflash", "model": "x", "tree": obj}).tree == obj
    with pytest.raises(ConfigError, match="one number in \\[0, 1\\] per path"):
        SpeculativeConfig.parse({"method": "dflash", "model": "x",
                                 "tree": {"paths": PATHS, "conditional": [0.5]}})
    with pytest.raises(ConfigError, match="optionally 'conditional'"):
        SpeculativeConfig.parse({"method": "dflash", "model": "x", "tree": {"path": PATHS}})
    assert ok.tree_order == "confidence"
    assert SpeculativeConfig.parse({"method": "dflash", "model": "x",
                                    "tree_order": "fixed"}).tree_order == "fixed"
    with pytest.raises(ConfigError, match="tree_order must be one of confidence, fixed") as err:
        SpeculativeConfig.parse({"method": "dflash", "model": "x", "tree_order": "reach"})
    assert err.value.param == "speculative_config.tree_order"


def test_load_tree_sources(tmp_path):
    import json

    assert load_tree(None, str(tmp_path), 7) is None  # no tree.json: chains
    (tmp_path / "tree.json").write_text(json.dumps({"paths": PATHS, "conditional": [0.5] * 7}))
    t = load_tree(None, str(tmp_path), 2)
    assert t.num_nodes == 6 and t.conditional == (0.5,) * 6
    assert load_tree(None, str(tmp_path), 7, why_not="no masks") is None  # skipped, not fatal
    with pytest.raises(TreeError, match="no masks"):
        load_tree(PATHS, None, 7, why_not="no masks")
    assert load_tree("chain", str(tmp_path), 7) is None
    assert not t.dynamic and load_tree(None, str(tmp_path), 2, dynamic=True).dynamic
    assert load_tree([[0], [0, 0]], None, 7) is None  # a chain spelled as paths
    (tmp_path / "tree.json").write_text("{broken")
    assert load_tree(None, str(tmp_path), 7) is None


# -- end to end -------------------------------------------------------------------------------------

PROMPTS = random_prompts([1, 7, 12, 29, 41], seed=71)
MAX_TOKENS = [30, 19, 26, 11, 33]
TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [1, 1], [0, 0, 0], [1, 0, 0]]


class TreeOracle:
    """Proposes the tree's nodes from the target's true greedy continuation: at each depth the
    true token is the candidate of one rank (drawn at random, 0 or 1) and the other ranks get
    wrong tokens, so accepted paths go through every branch of the tree."""

    capture_layers: tuple[int, ...] = ()
    lookahead_slots = 0
    draft_seconds = 0.0
    windows: dict[str, list[int]] = {}  # chains (or a tree in its fixed order) only

    def __init__(self, futures, tree: DraftTree, vocab: int, seed: int = 0) -> None:
        self.futures, self.tree, self.vocab = futures, tree, vocab
        self.num_speculative_tokens = tree.max_depth
        self.num_drafts = tree.num_nodes
        self.rng = random.Random(seed)
        self.off_first_branch = 0

    def layer_specs(self):
        return []

    def bind(self, pool, backend):
        return None

    def propose(self, items, captured):
        out = {}
        for it in items:
            if not it.sampled or not it.num_drafts:
                continue
            req = it.item.request
            done = len(req.output_token_ids) + len(it.sampled)
            truth = self.futures[tuple(req.prompt_token_ids)][done:]
            right = [self.rng.randrange(2) for _ in range(self.tree.max_depth)]
            nodes = []
            for d, r in zip(self.tree.depths, self.tree.ranks):
                t = truth[d - 1] if d - 1 < len(truth) else 3
                nodes.append(t if r == right[d - 1] else (t + 1 + r) % self.vocab)
            self.off_first_branch += right[0] == 1
            out[req.request_id] = nodes
        return out


def _tree_llm(target, draft, tree_order="confidence", **kw):
    return make_llm(target, {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3,
                             "tree": TREE, "tree_order": tree_order}, **kw)


@pytest.mark.parametrize("layout,cache_dtype", [("NHD", "auto"), ("HND", "bfloat16")])
def test_tree_oracle_greedy_equals_plain(qwen3_target, draft_dir, baseline_cache, layout,
                                         cache_dtype):
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS, cache_dtype)
    llm = _tree_llm(qwen3_target, draft_dir, kv_cache_layout=layout, kv_cache_dtype=cache_dtype)
    tree = llm.engine.proposer.tree
    assert tree is not None and tree.num_nodes == len(TREE)
    futures = {tuple(p): w for p, w in zip(PROMPTS, want)}
    oracle = TreeOracle(futures, tree, 256)
    llm.engine.runner.proposer = oracle
    got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
    assert_same_tokens(got, want, "tree oracle")
    stats = llm.get_spec_decoding_stats()
    # windows were accepted through second-rank branches, and deep
    assert oracle.off_first_branch > 5
    assert stats.num_accepted_tokens_per_pos[2] > 0, stats


@pytest.mark.parametrize("kwargs", [
    {"block_size": 8, "num_kv_blocks": 14, "max_model_len": 96},  # preemption
    {"max_num_batched_tokens": 12},  # chunked prefill beside tree windows, windows trimmed
])
def test_tree_oracle_under_preemption_and_chunked_prefill(qwen3_target, draft_dir,
                                                          baseline_cache, kwargs):
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS)
    llm = _tree_llm(qwen3_target, draft_dir, **kwargs)
    futures = {tuple(p): w for p, w in zip(PROMPTS, want)}
    llm.engine.runner.proposer = TreeOracle(futures, llm.engine.proposer.tree, 256, seed=3)
    got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
    assert_same_tokens(got, want, f"tree oracle {kwargs}")
    if "num_kv_blocks" in kwargs:
        assert llm.engine.num_preemptions > 0
    assert llm.get_spec_decoding_stats().num_accepted_tokens > 0


def test_tree_oracle_tensor_parallel_equals_plain(qwen3_target, draft_dir, baseline_cache):
    """Two ranks (gloo), each holding one of the target's two KV heads: windows accepted
    through side branches move on both ranks, so outputs equal plain decoding's."""
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS)
    threads = torch.get_num_threads()
    llm = _tree_llm(qwen3_target, draft_dir, tensor_parallel_size=2)
    try:
        assert llm.engine.proposer.tree is not None
        futures = {tuple(p): w for p, w in zip(PROMPTS, want)}
        oracle = TreeOracle(futures, llm.engine.proposer.tree, 256, seed=5)
        llm.engine.runner.proposer = oracle
        got = token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]))
        assert_same_tokens(got, want, "tree oracle, 2 ranks")
        assert oracle.off_first_branch > 5
        assert llm.get_spec_decoding_stats().num_accepted_tokens_per_pos[2] > 0
    finally:
        llm.engine.tp.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("order,trim", [("confidence", True), ("fixed", True),
                                        ("confidence", False)])
def test_tree_with_dflash_draft_greedy_and_seeded(qwen3_target, draft_dir, baseline_cache, order,
                                                  trim):
    """The real DFlash proposer offering a tree, its nodes in each block's confidence order or
    in the tree's, from trimmed blocks or whole ones (as on CUDA): greedy and seeded outputs
    equal plain ones. In confidence order the windows' trees are not all the fixed one's (the
    nodes were reordered)."""
    want = baseline_cache(qwen3_target, PROMPTS, MAX_TOKENS)
    llm = _tree_llm(qwen3_target, draft_dir, tree_order=order)
    proposer, windows = llm.engine.proposer, []
    proposer._trim_rows = trim
    propose = proposer.propose

    def spy(items, captured):
        out = propose(items, captured)
        windows.extend(w.parents for w in proposer.windows.values())
        return out

    proposer.propose = spy
    assert_same_tokens(token_ids(llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS])), want,
                       "dflash tree")
    stats = llm.get_spec_decoding_stats()
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts * len(TREE) // 2
    fixed = list(proposer.tree.parents)
    if order == "fixed":
        assert windows == []
    else:
        assert windows and any(w != fixed for w in windows)
        assert all(p <= j for w in windows for j, p in enumerate(w))  # parents first
    params = [SamplingParams(max_tokens=m, temperature=0.8, top_k=40, seed=9 + i,
                             ignore_eos=True) for i, m in enumerate(MAX_TOKENS)]
    plain = make_llm(qwen3_target, None)
    assert token_ids(llm.generate(PROMPTS, params)) == token_ids(plain.generate(PROMPTS, params))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_accepted_side_branch_moves_to_the_slots_of_its_depths(layout):
    """After a tree window, the accepted nodes' K/V (every layer) and captured rows sit where
    a chain would have put them: node j of depth d at slot root + d, captured row root + d."""
    from types import SimpleNamespace

    from attention.groups import GroupSpec
    from attention.kv import LayerKV
    from engine.outputs import ScheduledRequest, StepPlan, StepResult
    from engine.runner import ModelRunner

    bs = 4
    group = GroupSpec("target", ("a", "b"), bs, 2, 8, torch.float32, "auto")
    shape = (6, 2, bs, 2, 8) if layout == "NHD" else (6, 2, 2, bs, 8)
    layers = [LayerKV(n, group, layout, torch.randn(shape)) for n in ("a", "b")]
    before = [kv.logical.clone() for kv in layers]
    req = Request("r", [1] * 5, SamplingParams(max_tokens=20))
    req.num_computed_tokens, req.block_table = 5, [3, 5, 1]
    parents = [0, 0, 1, 2]  # nodes 1, 2 under the root; 3 under 1; 4 under 2
    item = ScheduledRequest(req, 5, [7, 8, 9, 10], False, parents)
    result = StepResult(sampled={"r": [8, 10, 11]}, num_accepted={"r": 2},
                        accepted_paths={"r": [2, 4]})
    captured = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)  # 2 other rows first
    runner = SimpleNamespace(kv_layers=layers, block_size=bs, device=torch.device("cpu"))
    runner.move_slots = lambda src, dst: ModelRunner.move_slots(runner, src, dst)
    out = ModelRunner._keep_paths(runner, StepPlan([item]), {"r": 2}, result, captured)

    def slot(p):  # K and V of position p: [block, :, offset] of the logical view
        return req.block_table[p // bs], slice(None), p % bs

    root = 5
    for kv, old in zip(layers, before):
        for depth, node in ((1, 2), (2, 4)):
            assert torch.equal(kv.logical[slot(root + depth)], old[slot(root + node)])
        assert torch.equal(kv.logical[slot(root + 3)], old[slot(root + 3)])  # untouched
    assert torch.equal(out[2 + 1], captured[2 + 2]) and torch.equal(out[2 + 2], captured[2 + 4])
    assert torch.equal(out[:3], captured[:3]) and torch.equal(out[5:], captured[5:])
