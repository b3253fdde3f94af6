"""The engine's choice of bf16 products (``ModelConfig.products``) reaches the target and its
DFlash draft, and speculative greedy output stays the target's own with the pair kernel."""

from __future__ import annotations

import pytest

import engine.args
from attention import cpu_kernel
from models import panel_linear

from .helpers import assert_same_tokens, greedy, make_llm, random_prompts, token_ids


def _pair_ops(module) -> list:
    return [m.packed.op for m in module.modules() if getattr(m, "packed", None) is not None]


def test_pair_products_reach_the_draft_and_greedy_stays_exact(monkeypatch, qwen3_target,
                                                              draft_dir):
    if not panel_linear.pairs_available():
        pytest.skip("the CPU kernels are not built with AVX512_BF16 here")
    monkeypatch.setattr(engine.args, "auto_products", lambda *args, **kwargs: "pairs")
    prompts = random_prompts([5, 17, 9])
    plain = make_llm(qwen3_target, dtype="bfloat16")
    assert plain.engine.config.model.products == "pairs"
    want = token_ids(plain.generate(prompts, greedy(24)))
    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(draft_dir),
                                  "num_speculative_tokens": 3}, dtype="bfloat16")
    run = cpu_kernel.load().bf16_dp_linear
    target, draft = llm.engine.model, llm.engine.proposer.draft
    for model in (target, draft):
        ops = _pair_ops(model)
        assert ops and all(getattr(op, "_forward", None) is run for op in ops)
    assert_same_tokens(token_ids(llm.generate(prompts, greedy(24))), want, "pairs")
