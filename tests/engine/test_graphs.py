"""Static, padded target passes (``engine.graphs``): configuration, padding, and the tokens of
the static path run eagerly on the CPU against the plain path (CUDA capture: tests/gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.backends.base import AttentionBatch
from engine.args import EngineArgs, capture_sizes, graph_config
from engine.config import ConfigError, GraphConfig
from engine.kv_pool import KVBudgetError, plan_pool
from engine.llm import LLM
from engine.runner import slots_for
from engine.sampling_params import SamplingParams

SIZES = (1, 2, 4, 8, 16, 24, 32, 48)
PROMPTS = [
    [5, 17, 33, 99, 120, 7, 8, 9],
    [40, 41],
    list(range(3, 90)),  # longer than a row plan: its prefill runs eagerly
    [77],
    [6] * 13,
    [123, 45, 67, 89, 12, 34, 56, 78, 90, 21, 43, 65, 87, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
]


def test_capture_sizes_ladder():
    assert capture_sizes(512) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192,
                                  224, 256, 320, 384, 448, 512)
    assert capture_sizes(100)[-2:] == (96, 100)  # the maximum itself is always a size
    assert capture_sizes(1) == (1,)
    sizes = capture_sizes(512)
    # above 32 tokens a padded step wastes less than a third of its rows (a quarter from 48)
    assert all((b - a - 1) / b < 1 / 3 for a, b in zip(sizes, sizes[1:]) if a >= 32)
    assert all((b - a - 1) / b < 1 / 4 for a, b in zip(sizes, sizes[1:]) if a >= 48)


def test_graph_config_sizes():
    cfg = GraphConfig((1, 2, 4, 8))
    assert [cfg.size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    for bad in ((), (2, 1), (0, 1), (1, 1, 2)):
        with pytest.raises(ConfigError):
            GraphConfig(bad)


def test_graphs_only_where_they_can_run():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_config(cuda, "flashinfer", 1, False, 64) == GraphConfig(capture_sizes(64))
    assert graph_config(cuda, "flashinfer", 1, True, 64) is None  # enforce_eager
    assert graph_config(cuda, "torch", 1, False, 64) is None  # shapes follow the contexts
    assert graph_config(cuda, "flashinfer", 2, False, 64) is None  # tensor parallel
    assert graph_config(cpu, "torch", 1, False, 64) is None
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="max_cudagraph_capture_size"):
            graph_config(cuda, "flashinfer", 1, False, bad)


def test_cpu_engine_config_has_no_graphs(tiny_llama_dir):
    cfg = EngineArgs(model=str(tiny_llama_dir), speculative_config=None).create_engine_config()
    assert cfg.graphs is None


def test_pool_reserves_the_pad_block():
    from attention.groups import LayerKVSpec, build_groups

    groups = list(build_groups([LayerKVSpec("l0", "target", 2, 16, "float32", 16)],
                               torch.float32).values())
    per_block = groups[0].bytes_per_block_per_layer
    assert plan_pool(groups, 4 * per_block, 64, 0, reserved_blocks=0).num_blocks == 4
    with pytest.raises(KVBudgetError, match=r"needs 4 blocks \(plus 1 reserved\)"):
        plan_pool(groups, 4 * per_block, 64, 0, reserved_blocks=1)


def static_llm(model_dir, **kwargs) -> LLM:
    """An engine whose eligible steps go through the static, padded path, run eagerly."""
    args = dict(model=str(model_dir), dtype="float32", speculative_config=None,
                max_model_len=128, kv_cache_memory="8MiB")
    args.update(kwargs)
    cfg = EngineArgs(**args).create_engine_config()
    return LLM.from_engine_config(dataclasses.replace(cfg, graphs=GraphConfig(SIZES, False)))


class CountingRuns:
    """Counts the steps the static path ran and the sizes they were padded to."""

    def __init__(self, graphs) -> None:
        self.sizes: list[int] = []
        self._run = graphs.run
        graphs.run = self

    def __call__(self, ids, positions, batch):
        self.sizes.append(len(ids))
        return self._run(ids, positions, batch)


def test_static_path_reserves_and_pads(tiny_llama_dir):
    llm = static_llm(tiny_llama_dir)
    engine = llm.engine
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.config.capture
    pad_block = engine.pool.num_blocks - 1
    assert engine.blocks.num_blocks == pad_block  # no request is ever given the pad block
    assert graphs.pad_slot == pad_block * engine.config.cache.block_size
    bs = engine.config.cache.block_size
    batch = AttentionBatch((1, 3), (10, 7), ((0,), (1,)),
                           torch.cat([slots_for([0], 9, 10, bs), slots_for([1], 4, 7, bs)]),
                           causal=True, block_size=bs)
    padded = graphs.pad(batch, 8)
    assert padded.q_lens == (1, 3, 1, 1, 1, 1) and padded.kv_lens == (10, 7, 1, 1, 1, 1)
    assert padded.block_tables[2:] == ((pad_block,),) * 4
    assert padded.slot_mapping[4:].tolist() == [graphs.pad_slot] * 4
    assert torch.equal(padded.slot_mapping[:4], batch.slot_mapping)
    assert graphs.fits(batch)
    long = AttentionBatch((65,), (65,), ((0,),), slots_for([0], 0, 65, bs), True, bs)
    assert not graphs.fits(long)  # more than a row plan's queries: eager
    many = AttentionBatch((1,) * 49, (5,) * 49, ((0,),) * 49, torch.zeros(49, dtype=torch.long),
                          True, bs)
    assert not graphs.fits(many)  # more tokens than the largest size: eager
    block = dataclasses.replace(batch, causal=False)
    assert not graphs.fits(block)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_static_path_gives_the_plain_tokens(model, request):
    model_dir = request.getfixturevalue(model)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    params = [greedy, seeded] * (len(PROMPTS) // 2)
    plain = LLM(model=str(model_dir), dtype="float32", speculative_config=None,
                max_model_len=128, kv_cache_memory="8MiB").generate(PROMPTS, params)
    llm = static_llm(model_dir)
    runs = CountingRuns(llm.engine.runner.graphs)
    static = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in static] == [o.outputs[0].token_ids for o in plain]
    # decode steps went through the static path, padded to sizes of the ladder (6 requests: 8)
    assert len(runs.sizes) >= 15 and set(runs.sizes) <= {1, 2, 3, 4, 5, 6} | set(SIZES)


def test_static_path_respects_the_largest_size(tiny_llama_dir):
    """More decode rows than the largest size run eagerly, with the same tokens."""
    prompts = [[i + 3, i + 4] for i in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", speculative_config=None,
                max_model_len=128, kv_cache_memory="8MiB").generate(prompts, params)
    cfg = EngineArgs(model=str(tiny_llama_dir), dtype="float32", speculative_config=None,
                     max_model_len=128, kv_cache_memory="8MiB").create_engine_config()
    llm = LLM.from_engine_config(dataclasses.replace(cfg, graphs=GraphConfig((1, 2, 4), False)))
    runs = CountingRuns(llm.engine.runner.graphs)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert runs.sizes == []  # ten decode rows never fit four
