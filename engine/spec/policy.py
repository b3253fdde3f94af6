"""Build the speculation controller for an engine: acceptance seed, measured step costs."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from attention.dtypes import dtype_name
from engine import measure_cache
from engine.spec.acceptance import (
    DEFAULT_PRIOR,
    AcceptanceModel,
    expected_gains,
    load_seed_curve,
)
from engine.spec.controller import SpecController
from engine.spec.cost import StepCostModel, measure_step_costs
from engine.spec.stats import SpecDecodingStats
from engine.spec.tree import DraftTree, slots_needed

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.config import EngineConfig
    from engine.runner import ModelRunner
    from engine.spec.base import Proposer

log = logging.getLogger("specserve.spec")

COST_CACHE_VERSION = 25  # 9: packed weights, attention on two threads sooner; 10: fused layer ops;
# 11: one row padded to the fastest row count; 12: packed draft weights, context writes
# deferred per request; 13: AVX2 kernels' vectors kept in registers; 14: direct oneDNN products;
# 15: the draft pass priced from the proposer's own times; 16: direct products held to probed
# row counts (padded and split); 17: compiled argmax, logits kept in the model dtype; 18: direct
# products exact up to 64 rows, layer ops with 512-bit vectors; 19: a step's tokens in all on
# the token axis, measured on both sides of the 16-row tile edges; 20: lines past the time
# budget measured sparsely, not scaled from the line below; 21: bf16 AVX2 panel products;
# 22: a drafting request runs only the slots its drafts need, priced per slot; 23: every line
# timed (sparsely past the time budget), none extrapolated from another; 24: bf16 products
# from the AVX512_BF16 pair kernel where measured faster (the choice in the key); 25: a tree's
# nodes ordered per block by the draft's confidence (engine.spec.tree_order), in the draft pass


def build_controller(config: EngineConfig, proposer: Proposer, runner: ModelRunner,
                     blocks: BlockManager, groups: dict[str, str]) -> SpecController:
    spec = config.speculative
    assert spec is not None
    k = proposer.num_drafts
    tree = proposer.tree
    seed = load_seed_curve(spec.model) if spec.model else None
    if tree is not None:
        seed = tree_seed(tree, seed)
    acceptance = AcceptanceModel(k, seed, parents=acceptance_parents(tree))
    cost, path = None, None
    if spec.adaptive:
        cost, path = step_costs(config, proposer, runner, blocks, groups)
    stats = SpecDecodingStats(proposer.num_speculative_tokens, max_verified=k)
    ctl = SpecController(k, acceptance, cost, stats, adaptive=spec.adaptive,
                         max_batch=spec.disable_by_batch_size, tree=tree)
    if path is not None:
        # costs refined by real steps replace the startup measurement in the cache
        ctl.on_refined = lambda model: measure_cache.save(path, model.to_json())
    return ctl


def acceptance_parents(tree: DraftTree | None) -> tuple[int, ...] | None:
    """The tree the acceptance model counts drafts in (``None``: a chain). A tree ordered per
    block (``engine.spec.tree_order``) has no fixed parents: its ``j``-th draft is the block's
    ``j``-th most likely node, under its first draft in one block and beside it in the next,
    so each draft's rate is its own chance of acceptance, as if hung from the root. (Counted
    under the fixed tree's parents, the second draft's rate, learned from blocks where it was
    the first's sibling and blocks where it was its child, came to 0.20 and was multiplied by
    the first's 0.45 where the fixed tree made it a child: one stream of held-out chat then
    verified a single draft at 1,442 of 1,765 steps.)"""
    if tree is None:
        return None
    return (0,) * tree.num_nodes if tree.dynamic else tree.parents


def tree_seed(tree: DraftTree, chain: list[float] | None) -> list[float]:
    """Prior acceptance of each node given its parent: the tree's measured ``conditional``
    when it ships one; else the chain's curve at the node's depth for rank 0, halved per rank
    beyond it (a prior only: live verifications replace it within a few dozen steps). For a
    tree ordered per block, each node's chance of acceptance (see
    :func:`acceptance_parents`), non-increasing."""
    if tree.conditional is not None:
        seed = list(tree.conditional)
    else:
        curve = list(chain or [DEFAULT_PRIOR])
        seed = [curve[min(d, len(curve)) - 1] * 0.5**r for d, r in zip(tree.depths, tree.ranks)]
    return expected_gains(seed, tree.parents) if tree.dynamic else seed


def step_costs(config: EngineConfig, proposer: Proposer, runner: ModelRunner,
               blocks: BlockManager, groups: dict[str, str]) -> tuple[StepCostModel, Path]:
    """The step cost table for this machine and engine shape (cached, else measured) and
    its cache file."""
    mc, sc, spec = config.model, config.scheduler, config.speculative
    k = proposer.num_drafts
    max_rows = min(sc.max_num_seqs, 64)
    max_per_row = k + 1
    max_tokens = sc.max_num_batched_tokens
    hf = mc.hf_config
    key = {
        "version": COST_CACHE_VERSION,
        "machine": measure_cache.machine_signature(runner.device),
        "model": {name: hf.get(name) for name in (
            "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "tie_word_embeddings")},
        "dtype": dtype_name(mc.dtype),
        "products": mc.products,  # the bf16 product kernel (engine.dtype_choice.auto_products)
        "kv": groups,
        "backend": config.attention_backend,
        "block_size": config.cache.block_size,
        "speculative": {"method": spec.method, "k": k,
                        "draft": _file_digest(spec.model, "config.json"),
                        "backend": spec.attention_backend},
        "ladder": [max_rows, max_per_row, max_tokens],
    }
    if config.tensor_parallel_size > 1:  # sharded steps cost differently (key unchanged at 1)
        key["tensor_parallel_size"] = config.tensor_parallel_size
    path = measure_cache.cache_path("step-costs", key)
    cached = measure_cache.load(path)
    if cached is not None:
        try:
            model = StepCostModel.from_json(cached)
            log.info("step costs from %s: %s", path, model.describe())
            return model, path
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring measurement cache %s (%s); measuring again", path, exc)
    t0 = time.perf_counter()
    model = measure_step_costs(
        runner, blocks, max_rows=max_rows, max_per_row=max_per_row, max_tokens=max_tokens,
        with_draft=proposer.lookahead_slots > 0, vocab_size=mc.vocab_size,
        lookahead=proposer.lookahead_slots, max_model_len=mc.max_model_len,
        draft_slots=slots_needed(proposer.tree, k)[-1],
    )
    log.info("measured step costs in %.1f s: %s", time.perf_counter() - t0, model.describe())
    measure_cache.save(path, model.to_json())
    return model, path


def _file_digest(folder: str | None, name: str) -> str | None:
    if folder is None:
        return None
    try:
        return hashlib.sha256((Path(folder).expanduser() / name).read_bytes()).hexdigest()[:16]
    except OSError:
        return None
