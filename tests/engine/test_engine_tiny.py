"""The whole engine on tiny random Llama / Qwen3 checkpoints (float32) against Hugging Face."""

from __future__ import annotations

import json

import pytest
import torch

from attention.backends.base import AttentionBatch
from engine.engine import RequestValidationError
from engine.kv_pool import KVBudgetError
from engine.llm import LLM
from engine.runner import slots_for
from engine.sampling_params import SamplingParams
from models.hf_folder import ModelConfigError
from models.loader import UnsupportedArchitectureError
from models.resolve import UnknownModelError

PROMPTS = [
    [5, 17, 33, 99, 120, 7, 8, 9],
    [40, 41],
    [3, 200, 201, 202, 203, 204, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64],
    [77],
    [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190,
     210, 220, 230, 240, 250, 11, 21, 31, 41, 51, 61, 71, 81, 91, 101, 111],
    [250, 249, 248, 247, 246],
    [6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6],
    [123, 45, 67, 89, 12, 34, 56, 78, 90, 21, 43, 65, 87, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
]


def make_llm(model_dir, **kwargs) -> LLM:
    args = dict(dtype="float32", speculative_config=None, max_model_len=128,
                kv_cache_memory="8MiB")
    args.update(kwargs)
    return LLM(model=str(model_dir), **args)


@pytest.fixture(scope="module")
def hf_models(tiny_llama_dir, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    models = {}
    for name, path in (("llama", tiny_llama_dir), ("qwen3", tiny_qwen3_dir)):
        models[path] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return models


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Plain greedy continuation with full forwards (no EOS handling)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = hf(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# --------------------------------------------------------------------------- against HF


def _engine_logits(engine, chunks: list[list[int]]) -> torch.Tensor:
    """Run ``chunks`` of one sequence through the engine's model, chunk after chunk, reading
    earlier chunks from the paged cache; returns the logits of every position."""
    bs = engine.config.cache.block_size
    total = sum(len(c) for c in chunks)
    table: list[int] = []
    engine.blocks.grow(table, total)
    table = list(reversed(table))  # non-contiguous order on purpose
    kv_layers = engine.pool.layers(engine.target_layers)
    out, start = [], 0
    try:
        with torch.inference_mode():
            for chunk in chunks:
                end = start + len(chunk)
                batch = AttentionBatch(
                    q_lens=(len(chunk),), kv_lens=(end,), block_tables=(tuple(table),),
                    slot_mapping=slots_for(table, start, end, bs), causal=True, block_size=bs,
                )
                meta = engine.runner.backend.build_metadata(batch, engine.device)
                hidden, _ = engine.model(torch.tensor(chunk), torch.arange(start, end), meta,
                                         kv_layers)
                out.append(engine.model.compute_logits(hidden).float())
                start = end
    finally:
        engine.blocks.free(table)
    return torch.cat(out)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_logits_match_hf(tiny_model_dir, hf_models, layout) -> None:
    engine = make_llm(tiny_model_dir, kv_cache_layout=layout).engine
    ids = PROMPTS[4]
    ours = _engine_logits(engine, [ids])
    with torch.no_grad():
        ref = hf_models[tiny_model_dir](torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_chunked_and_decode_logits_match_hf(tiny_model_dir, hf_models) -> None:
    """A prefill split into chunks, then single-token decodes, all through the paged cache."""
    engine = make_llm(tiny_model_dir, block_size=4).engine
    ids = PROMPTS[4]
    chunks = [ids[:10], ids[10:11], ids[11:27], ids[27:28], ids[28:29], ids[29:]]
    ours = _engine_logits(engine, chunks)
    with torch.no_grad():
        ref = hf_models[tiny_model_dir](torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# max relative logit error vs HF with a quantized cache (observed on the tiny Llama: bf16
# 0.009, fp16 0.001, e4m3 0.14, e5m2 0.25; bounds ~2x that). The per-element precision of the
# cache format, carried through two layers, is all that separates them from float32.
CACHE_TOL = {"bfloat16": 0.03, "float16": 0.005, "fp8_e4m3": 0.3, "fp8_e5m2": 0.5}


@pytest.mark.parametrize("cache_dtype", list(CACHE_TOL))
def test_quantized_cache_logits_close_to_hf(tiny_llama_dir, hf_models, cache_dtype) -> None:
    engine = make_llm(tiny_llama_dir, kv_cache_dtype=cache_dtype).engine
    kv = engine.pool.layer(engine.target_layers[0])
    assert kv.physical.dtype != torch.float32
    ids = PROMPTS[4]
    ours = _engine_logits(engine, [ids[:10], ids[10:]])
    with torch.no_grad():
        ref = hf_models[tiny_llama_dir](torch.tensor([ids])).logits[0].float()
    assert torch.isfinite(ours).all()
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err < CACHE_TOL[cache_dtype], err
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.7


def test_layouts_give_identical_tokens(tiny_model_dir) -> None:
    nhd = token_ids(make_llm(tiny_model_dir, kv_cache_layout="NHD").generate(PROMPTS, greedy()))
    hnd = token_ids(make_llm(tiny_model_dir, kv_cache_layout="HND").generate(PROMPTS, greedy()))
    assert nhd == hnd


def test_greedy_matches_hf(tiny_model_dir, hf_models) -> None:
    hf = hf_models[tiny_model_dir]
    llm = make_llm(tiny_model_dir)
    prompt = PROMPTS[0]
    ours = token_ids(llm.generate([prompt], greedy(32)))[0]
    ref = hf_greedy(hf, prompt, 32)
    assert ours == ref
    assert len(set(ours)) > 8, "degenerate continuation: the comparison would be too weak"


def test_greedy_with_min_tokens_matches_hf_generate(tiny_model_dir, hf_models) -> None:
    """HF ``generate(do_sample=False, min_new_tokens=32)`` masks EOS like ``min_tokens``."""
    hf = hf_models[tiny_model_dir]
    llm = make_llm(tiny_model_dir)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    (out,) = llm.generate([prompt], params)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                          min_new_tokens=32)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].finish_reason == "length"


def _first_new_index(tokens: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` that does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_from_generation_config_stops(tiny_llama_dir, tmp_path) -> None:
    """Point ``generation_config.eos_token_id`` at the 6th new token of the greedy
    continuation: generation stops right after it with finish_reason "stop"."""
    ref = token_ids(make_llm(tiny_llama_dir).generate([PROMPTS[0]], greedy(32)))[0]
    k = _first_new_index(ref, 5)
    for f in tiny_llama_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ref[k]]}))
    llm = make_llm(tmp_path)
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=32))
    assert out.outputs[0].token_ids == ref[: k + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    (ign,) = llm.generate([PROMPTS[0]], greedy(32))  # ignore_eos
    assert ign.outputs[0].token_ids == ref


def test_stop_token_ids_stop_with_reason(tiny_llama_dir) -> None:
    llm = make_llm(tiny_llama_dir)
    ref = token_ids(llm.generate([PROMPTS[2]], greedy(32)))[0]
    k = _first_new_index(ref, 3)
    (out,) = llm.generate([PROMPTS[2]], greedy(32, stop_token_ids=[ref[k]]))
    c = out.outputs[0]
    assert c.token_ids == ref[: k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", ref[k])


# --------------------------------------------------------------------------- batch invariance


def test_batch_and_preemption_invariance(tiny_model_dir) -> None:
    alone_llm = make_llm(tiny_model_dir)
    alone = [token_ids(alone_llm.generate([p], greedy()))[0] for p in PROMPTS]
    assert alone_llm.engine.num_preemptions == 0

    batch_llm = make_llm(tiny_model_dir)
    batched = token_ids(batch_llm.generate(PROMPTS, greedy()))
    assert batched == alone

    # 8 blocks of 8 tokens for 8 requests of up to 59 tokens, a 16-token budget: chunked
    # prefills, decodes and recompute after preemption all interleave
    small = make_llm(tiny_model_dir, block_size=8, num_kv_blocks=8, max_model_len=64,
                     max_num_batched_tokens=16)
    squeezed = token_ids(small.generate(PROMPTS, greedy()))
    assert small.engine.num_preemptions > 0
    assert squeezed == alone
    assert small.engine.kv_usage == 0.0
    assert small.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize(
    "config",
    [
        dict(block_size=5),
        dict(block_size=1, num_kv_blocks=70, max_model_len=64),
        dict(max_num_batched_tokens=1),
        dict(max_num_seqs=1),
        dict(block_size=3, num_kv_blocks=22, max_model_len=64, max_num_batched_tokens=7),
    ],
    ids=["bs5", "bs1-preempt", "budget1", "seqs1", "bs3-preempt-chunked"],
)
def test_extreme_scheduling_keeps_greedy_output(tiny_llama_dir, config) -> None:
    base = token_ids(make_llm(tiny_llama_dir).generate(PROMPTS, greedy()))
    llm = make_llm(tiny_llama_dir, **config)
    assert token_ids(llm.generate(PROMPTS, greedy())) == base
    if "num_kv_blocks" in config:
        assert llm.engine.num_preemptions > 0
    assert llm.engine.blocks.num_used_blocks == 0


def test_seeded_sampling_survives_preemption(tiny_llama_dir) -> None:
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=24,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    base = token_ids(make_llm(tiny_llama_dir).generate(PROMPTS, params))
    small = make_llm(tiny_llama_dir, block_size=8, num_kv_blocks=8, max_model_len=64,
                     max_num_batched_tokens=16)
    assert token_ids(small.generate(PROMPTS, params)) == base
    assert small.engine.num_preemptions > 0


def test_outputs_in_prompt_order_and_kv_freed(tiny_llama_dir) -> None:
    llm = make_llm(tiny_llama_dir)
    params = [greedy(max_tokens=n) for n in (5, 1, 9, 3, 7, 2, 4, 6)]
    outs = llm.generate(PROMPTS, params)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 9, 3, 7, 2, 4, 6]
    assert all(o.finished for o in outs)
    assert llm.engine.blocks.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks(tiny_llama_dir) -> None:
    engine = make_llm(tiny_llama_dir).engine
    engine.add_request("x", PROMPTS[4], greedy(50))
    engine.add_request("y", PROMPTS[0], greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    assert engine.abort_request("x")
    assert engine.abort_request("y")
    assert not engine.abort_request("y")
    assert engine.blocks.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- speculation


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}  # fixed K: every step verifies


def test_ngram_speculation_keeps_greedy_output(tiny_model_dir) -> None:
    """Verify windows with rejected drafts (rolled back, slots overwritten later) must not
    change greedy output, alone or batched under preemption."""
    base = token_ids(make_llm(tiny_model_dir).generate(PROMPTS, greedy(32)))
    spec_llm = make_llm(tiny_model_dir, speculative_config=NGRAM)
    spec = token_ids(spec_llm.generate(PROMPTS, greedy(32)))
    stats = spec_llm.get_spec_decoding_stats()
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert spec == base
    squeezed = make_llm(tiny_model_dir, speculative_config=NGRAM, block_size=8,
                        num_kv_blocks=8, max_model_len=64, max_num_batched_tokens=16)
    short = token_ids(squeezed.generate(PROMPTS, greedy(24)))
    assert squeezed.engine.num_preemptions > 0
    assert short == [b[:24] for b in base]


def test_ngram_speculation_keeps_seeded_samples(tiny_llama_dir) -> None:
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    base = token_ids(make_llm(tiny_llama_dir).generate(PROMPTS, params))
    spec = token_ids(make_llm(tiny_llama_dir, speculative_config=NGRAM).generate(PROMPTS, params))
    assert spec == base


# --------------------------------------------------------------------------- bad input


def test_unknown_model_path(tmp_path) -> None:
    with pytest.raises(UnknownModelError, match="no such path"):
        LLM(model=str(tmp_path / "does-not-exist"), dtype="float32", speculative_config=None)
    with pytest.raises(UnknownModelError, match="config.json"):
        LLM(model=str(tmp_path), dtype="float32", speculative_config=None)  # empty folder


def test_unsupported_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64,
        "n_layer": 2, "n_head": 4, "vocab_size": 256,
    }))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path), dtype="float32", speculative_config=None)


@pytest.mark.parametrize(
    "mutate, text",
    [
        (lambda cfg: "{not json", "not valid JSON"),
        (lambda cfg: {k: v for k, v in cfg.items() if k != "hidden_size"}, "hidden_size"),
        (lambda cfg: {**cfg, "num_attention_heads": "four"}, "malformed"),
        (lambda cfg: {**cfg, "num_key_value_heads": 3}, "divisible"),
        (lambda cfg: {k: v for k, v in cfg.items() if k != "architectures"}, "architectures"),
    ],
    ids=["json", "missing", "type", "heads", "no-arch"],
)
def test_malformed_config(tmp_path, tiny_llama_dir, mutate, text) -> None:
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    new = mutate(cfg)
    (tmp_path / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(ModelConfigError, match=text):
        LLM(model=str(tmp_path), dtype="float32", speculative_config=None)


def test_prompt_longer_than_max_model_len(tiny_llama_dir) -> None:
    llm = make_llm(tiny_llama_dir, max_model_len=32)
    with pytest.raises(RequestValidationError, match="maximum context length") as info:
        llm.generate([[5] * 40], greedy(4))
    assert info.value.param == "prompt"
    assert "32" in str(info.value)
    # prompt + max_tokens over the limit
    with pytest.raises(RequestValidationError, match="maximum context length"):
        llm.generate([[5] * 20], greedy(13))
    # the engine keeps serving
    assert len(token_ids(llm.generate([[5] * 20], greedy(12)))[0]) == 12


def test_failed_batch_leaves_no_request_behind(tiny_llama_dir) -> None:
    """A batch whose second prompt is invalid raises, and the valid first prompt must not stay
    queued in the engine (it would run, unowned, inside the next generate call)."""
    llm = make_llm(tiny_llama_dir, max_model_len=32)
    with pytest.raises(RequestValidationError):
        llm.generate([[5] * 4, [5] * 40], greedy(4))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, text", [([], "empty"), ([5, 256], "out of vocabulary"),
                                          ([5, -1], "out of vocabulary")])
def test_bad_prompt_tokens(tiny_llama_dir, prompt, text) -> None:
    engine = make_llm(tiny_llama_dir).engine
    with pytest.raises(RequestValidationError, match=text):
        engine.add_request("bad", prompt, greedy(4))
    assert not engine.has_unfinished_requests()


def test_kv_budget_too_small(tiny_llama_dir) -> None:
    with pytest.raises(KVBudgetError) as info:
        make_llm(tiny_llama_dir, kv_cache_memory="16KiB", max_model_len=128)
    msg = str(info.value)
    assert "max_model_len=128" in msg
    assert "max-model-len" in msg and "kv-cache-memory" in msg
