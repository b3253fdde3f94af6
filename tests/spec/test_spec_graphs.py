"""Speculation through the static, padded passes (``engine.graphs``, run eagerly on the CPU):
verify windows of K + 1 rows are padded like decode rows, draft blocks are padded to the
ladder, greedy with a draft still equals greedy without one, and the static block pass
proposes the drafts the eager one proposes."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from engine.config import GraphConfig
from engine.llm import LLM

from .helpers import greedy, make_llm, random_prompts, token_ids

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def _generate(llm: LLM, prompts, max_tokens):
    """Tokens, each step's drafts, and the largest query count of each static pass."""
    drafts: list[dict] = []
    propose = llm.engine.proposer.propose

    def recording(items, captured):
        out = propose(items, captured)
        drafts.append(out)
        return out

    llm.engine.proposer.propose = recording
    seen: dict[str, list[int]] = {"target": [], "draft": []}
    for name, passes in (("target", llm.engine.runner.graphs),
                         ("draft", llm.engine.proposer._graphs)):
        if passes is None:
            continue

        def counting(ids, positions, batch, _run=passes.run, _seen=seen[name]):
            _seen.append(max(batch.q_lens))
            return _run(ids, positions, batch)

        passes.run = counting
    out = llm.generate(prompts, [greedy(m) for m in max_tokens])
    return token_ids(out), drafts, seen


def _pin_step_costs(llm: LLM, cost) -> None:
    """Give the adaptive controller a fixed copy of ``cost`` and stop it learning from step
    times: two engines measure their steps differently, and the comparison is of the passes,
    not of the machine's timing (with measured feedback the two controllers stopped drafting
    on different steps now and then)."""
    ctl = llm.engine.scheduler.controller
    ctl.cost = copy.deepcopy(cost)
    ctl.observe_step = lambda *args, **kwargs: None


@pytest.mark.parametrize("adaptive", [False, True])
def test_static_passes_equal_plain_greedy(qwen3_target, draft_dir, baseline_cache, adaptive):
    prompts = random_prompts([5, 30, 12, 70, 3])
    max_tokens = [24] * len(prompts)
    plain = baseline_cache(qwen3_target, prompts, max_tokens)
    spec = {"method": "dflash", "model": str(draft_dir), "adaptive": adaptive}
    eager = make_llm(qwen3_target, spec)
    static = LLM.from_engine_config(
        dataclasses.replace(eager.engine_config, graphs=GraphConfig(SIZES, False)))
    assert eager.engine.runner.graphs is None and eager.engine.proposer._graphs is None
    assert static.engine.proposer._graphs.q_len == 4  # blocks of K + 1 = 4 queries
    if adaptive:
        cost = eager.engine.scheduler.controller.cost
        _pin_step_costs(eager, cost)
        _pin_step_costs(static, cost)
    tokens, drafts, seen = _generate(static, prompts, max_tokens)
    eager_tokens, eager_drafts, _ = _generate(eager, prompts, max_tokens)
    assert tokens == plain == eager_tokens
    assert drafts == eager_drafts and any(drafts)  # adaptive: at least its probes draft
    assert set(seen["draft"]) <= {4} and len(seen["draft"]) == sum(map(bool, drafts))
    if not adaptive:  # every step drafts and verifies K = 3: windows of 4 rows, padded
        assert sum(map(len, drafts)) > 10
        assert seen["target"] and max(seen["target"]) == 4
