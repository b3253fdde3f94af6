"""``benchmarks/bench_spec_policy.py --lockstep``: engines in processes of their own take turns
step by step, each running a closed loop of requests, and every prompt's greedy output comes
back in order."""

from __future__ import annotations

from benchmarks import bench_spec_policy as bsp
from engine import LLM, SamplingParams
from tests.spec.helpers import save_draft, save_target


def test_arrivals_keep_the_concurrency_and_return_outputs_in_order(tmp_path):
    target = save_target(tmp_path / "target")
    llm = LLM(model=str(target), dtype="float32", max_num_seqs=8)
    prompts = [[5, 6, 7], [9, 10], [4, 8], [3, 3, 3, 3], [11]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    loop = bsp.Arrivals(llm, prompts, params, concurrency=2)
    finished, steps = False, 0
    while not finished:
        _, finished = loop.steps(1)
        assert llm.engine.num_running + llm.engine.num_waiting <= 2  # never more in flight
        steps += 1
    assert steps >= 3 * 5  # three waves of two (or fewer) requests, five tokens each
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert loop.outputs() == [list(t) for t in expected]


def test_lockstep_turns_agree_with_batch_turns(tmp_path):
    target = save_target(tmp_path / "target")
    save_draft(tmp_path / "draft")
    common = dict(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=4)
    spec = {"method": "dflash", "model": str(tmp_path / "draft")}
    cache = tmp_path / "bench-measurements"  # the run's own (not the user's) measurements
    engines = {"none": bsp.EngineProcess(None, common, cache),
               "adaptive": bsp.EngineProcess(spec, common, cache)}
    try:
        prompts = [[5, 6, 7], [9, 10], [4, 8], [3, 3, 3, 3], [11], [12, 13]]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        stepped = bsp.measure_lockstep(engines, prompts, 3, params, turn_steps=2)
        batched = bsp.measure(engines, prompts, 3, params)
    finally:
        for engine in engines.values():
            engine.close()
    for name in engines:
        assert stepped[name]["outputs"] == batched[name]["outputs"]
        assert stepped[name]["tokens"] == 6 * 6 and stepped[name]["seconds"] > 0
    assert stepped["adaptive"]["outputs"] == stepped["none"]["outputs"]  # greedy: exact
    assert sum(stepped["adaptive"]["steps_by_k"]) >= 6 * 5  # one record per request step
    assert list(cache.glob("measurements/step-costs-*.json"))  # the adaptive engine's costs


def test_fixed_tree_takes_the_leading_paths_of_the_drafts_tree(tmp_path):
    import json

    import pytest

    paths = [[0], [0, 0], [1], [0, 0, 0]]
    (tmp_path / "tree.json").write_text(json.dumps({"paths": paths}))
    assert bsp.leading_tree_paths(tmp_path, 3) == paths[:3]
    with pytest.raises(SystemExit, match="4 nodes"):
        bsp.leading_tree_paths(tmp_path, 5)
    with pytest.raises(SystemExit, match="needs"):
        bsp.leading_tree_paths(tmp_path / "none", 2)
