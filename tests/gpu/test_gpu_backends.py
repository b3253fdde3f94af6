"""FlashInfer vs the torch backend on one pool, on CUDA (skipped cleanly without a GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="needs flashinfer (pip install specserve[gpu])")

from attention.backends import get_backend  # noqa: E402
from attention.backends.base import AttentionBatch  # noqa: E402
from attention.groups import LayerKVSpec, build_groups  # noqa: E402
from engine.kv_pool import KVPool  # noqa: E402
from engine.runner import slots_for  # noqa: E402

DEV = torch.device("cuda")
HEADS, KV_HEADS, DIM, BS = 8, 2, 128, 16


def _pool(layout: str, target_dtype: str, draft_dtype: str) -> KVPool:
    specs = [LayerKVSpec("t0", "target", KV_HEADS, DIM, target_dtype, BS),
             LayerKVSpec("d0", "draft", KV_HEADS, DIM, draft_dtype, BS)]
    groups = build_groups(specs, torch.bfloat16)
    return KVPool(list(groups.values()), num_blocks=64, layout=layout, device=DEV)


def _batch(q_lens, ctx_lens, causal, tables) -> AttentionBatch:
    kv_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    slots = torch.cat([slots_for(t, c, c + q, BS) for t, c, q in zip(tables, ctx_lens, q_lens)])
    return AttentionBatch(tuple(q_lens), tuple(kv_lens), tuple(tuple(t) for t in tables), slots,
                          causal=causal, block_size=BS)


CASES = {
    "decode": ([1, 1, 1], [37, 5, 80], True),
    "causal_prefill": ([20, 7], [0, 33], True),
    "draft_block": ([8, 8, 8], [12, 40, 3], False),
    # a long prefill next to decode and verify rows: two plans, outputs scattered into place
    "mixed_prefill_rows": ([100, 1, 5], [0, 20, 7], True),
}


@needs_flashinfer
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtypes", [("bfloat16", "fp8_e4m3"), ("fp8_e4m3", "bfloat16")])
@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_matches_torch_backend(layout, dtypes, case):
    torch.manual_seed(0)
    pool = _pool(layout, *dtypes)
    q_lens, ctx_lens, causal = CASES[case]
    perm = torch.randperm(64).tolist()
    tables = [perm[i * 8 : (i + 1) * 8] for i in range(len(q_lens))]
    for layer, group_causal in (("t0", causal), ("d0", causal and case != "draft_block")):
        kv = pool.layer(layer)
        # fill the context through the torch writer, then attend with both backends
        for t, c in zip(tables, ctx_lens):
            if c:
                ctx = _batch([c], [0], True, [t])
                k = torch.randn(c, KV_HEADS, DIM, device=DEV, dtype=torch.bfloat16)
                get_backend("torch", DEV).build_metadata(ctx, DEV).attend(
                    torch.randn(c, HEADS, DIM, device=DEV, dtype=torch.bfloat16), k, k.clone(), kv, DIM**-0.5)
        batch = _batch(q_lens, ctx_lens, group_causal, tables)
        n = batch.num_tokens
        q = torch.randn(n, HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(n, KV_HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(n, KV_HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        ref = get_backend("torch", DEV).build_metadata(batch, DEV).attend(q, k, v, kv, DIM**-0.5)
        out = get_backend("flashinfer", DEV).build_metadata(batch, DEV).attend(q, k, v, kv, DIM**-0.5)
        tol = 0.1 if kv.dtype.itemsize == 1 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _save_target(folder) -> None:
    """A random Qwen3 with FlashInfer's smallest head size (64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=1024, initializer_range=0.2)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("backend", [pytest.param("flashinfer", marks=needs_flashinfer), "torch"])
def test_greedy_speculation_equals_plain_greedy_on_gpu(tmp_path, backend, kv_dtype, eager):
    from engine import LLM, SamplingParams
    from models.dflash_init import draft_hf_config, random_draft, save_draft
    from models.hf_folder import load_hf_config
    from models.loader import decoder_config

    _save_target(tmp_path / "target")
    target = decoder_config(load_hf_config(tmp_path / "target"))
    dcfg = draft_hf_config(target, num_layers=1, block_size=8, mask_token_id=511)
    save_draft(random_draft(dcfg, std=0.2), dcfg, tmp_path / "draft")
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60)), [7]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    if backend == "torch" and not eager:
        pytest.skip("the torch backend runs eagerly (graphs need flashinfer)")
    common = dict(model=str(tmp_path / "target"), dtype="bfloat16", device="cuda",
                  attention_backend=backend, kv_cache_dtype=kv_dtype, kv_cache_memory="64MiB",
                  enforce_eager=eager)
    plain = LLM(speculative_config=None, **common).generate(prompts, params)
    llm = LLM(speculative_config={"method": "dflash", "model": str(tmp_path / "draft"),
                                  "kv_cache_dtype": "bfloat16", "adaptive": False}, **common)
    assert (llm.engine.runner.graphs is None) == eager
    spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@needs_flashinfer
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_cuda_graphs_give_the_eager_tokens(tmp_path, kv_dtype):
    """Decode steps replayed from captured graphs (padded to the ladder, pad rows on the
    reserved block) give the tokens eager steps give; long prompts still prefill eagerly."""
    from engine import LLM, SamplingParams

    _save_target(tmp_path)
    prompts = [[5, 17, 33, 99], list(range(3, 120)), [7], [9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    common = dict(model=str(tmp_path), dtype="bfloat16", device="cuda",
                  attention_backend="flashinfer", kv_cache_dtype=kv_dtype,
                  kv_cache_memory="64MiB", speculative_config=None, max_cudagraph_capture_size=16)
    eager = LLM(enforce_eager=True, **common).generate(prompts, params)
    llm = LLM(**common)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.config.sizes == (1, 2, 4, 8, 16)
    replays = []
    run = graphs.run
    graphs.run = lambda *a: replays.append(1) or run(*a)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in eager]
    assert len(replays) >= 30
