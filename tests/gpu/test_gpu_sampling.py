"""Every sampling feature on a CUDA device (skipped cleanly without one).

The sampler must work on CUDA logits with device generators, give the CPU's greedy decisions
on the same logits, keep seeded requests reproducible (alone, in a batch, under speculation)
and read the device back once per call.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from engine.request import Request
from engine.sampler import RowGroup, Sampler, probs_from
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
V = 1000
_ids = iter(range(10**9))


def make_req(prompt=(10, 11, 12), outputs=(), **params) -> Request:
    params.setdefault("max_tokens", 500)
    req = Request(f"g{next(_ids)}", list(prompt), SamplingParams(**params), (2,))
    req.output_token_ids = list(outputs)
    return req


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


GREEDY = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "repetition": {"repetition_penalty": 1.8},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.7},
    "min_tokens": {"min_tokens": 6, "stop_token_ids": [7]},
}


@pytest.mark.parametrize("feature", list(GREEDY))
def test_greedy_features_on_cuda_equal_cpu(feature):
    logits = _logits(12)
    logits[:, 2] += 10  # EOS is the best token: min_tokens must ban it
    outputs = [int(t) for t in logits[:4].argmax(-1)]

    def run(device):
        req = make_req(outputs=outputs, temperature=0.0, **GREEDY[feature])
        drafts = [int(t) for t in logits[1:4].argmax(-1)]
        return Sampler(0)(logits.to(device), [RowGroup(req, 0, drafts)])[req.request_id]

    cpu, gpu = run("cpu"), run(DEV)
    assert (gpu.tokens, gpu.num_accepted) == (cpu.tokens, cpu.num_accepted)
    if cpu.logprobs is not None:
        for a, b in zip(cpu.logprobs, gpu.logprobs):
            assert a.token_id == b.token_id and set(a.top) == set(b.top)
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


SAMPLED = {
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 1.0, "top_p": 0.5},
    "top_k": {"temperature": 1.0, "top_k": 3},
    "min_p": {"temperature": 1.0, "min_p": 0.2},
    "penalties": {"temperature": 0.9, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                  "frequency_penalty": 0.5},
    "min_tokens": {"temperature": 1.0, "min_tokens": 50},
    "logprobs": {"temperature": 1.0, "logprobs": 3},
}


@pytest.mark.parametrize("feature", list(SAMPLED))
def test_sampling_features_on_cuda_stay_in_support_and_are_seeded(feature):
    params = SAMPLED[feature]
    row = _logits(1, seed=4)[0]
    row[2] += 3.0  # EOS likely: min_tokens must never emit it
    probs = probs_from(row, SamplingParams(max_tokens=500, **params)).to(DEV)
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    gpu_row = row.to(DEV)

    def sequence(seed):
        req = make_req(seed=seed, **params)
        sampler = Sampler(0)
        for _ in range(20):
            res = sampler(gpu_row[None], [RowGroup(req, 0, [])])[req.request_id]
            req.output_token_ids += res.tokens
        assert req.generator is not None and req.generator.device.type == "cuda"
        return req.output_token_ids

    a = sequence(11)
    assert a == sequence(11)
    if "penalties" not in params:
        assert set(a) <= support
    if "min_tokens" in params:
        assert 2 not in a


def test_temperature_distribution_on_cuda():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device=DEV)
    n = 20_000
    reqs = [make_req(temperature=0.6) for _ in range(n)]
    out = Sampler(7)(logits.expand(n, -1), [RowGroup(r, i, []) for i, r in enumerate(reqs)])
    tokens = torch.tensor([out[r.request_id].tokens[0] for r in reqs])
    freq = torch.bincount(tokens, minlength=5).double() / n
    target = torch.softmax(logits.cpu() / 0.6, -1).double()
    assert float((freq - target).abs().max()) < 0.015


def test_seeded_request_same_alone_and_in_a_batch_on_cuda():
    rows = _logits(16, seed=9).to(DEV)
    alone = make_req(temperature=1.0, top_p=0.9, seed=3)
    for r in rows:
        res = Sampler(0)(r[None], [RowGroup(alone, 0, [])])[alone.request_id]
        alone.output_token_ids += res.tokens
    req = make_req(temperature=1.0, top_p=0.9, seed=3)
    other = make_req(temperature=1.0)
    sampler = Sampler(5)
    done = 0
    while done < 16:
        width = min(3, 16 - done)
        drafts = alone.output_token_ids[done + 1 : done + width]
        if done % 2:
            drafts = [(d + 1) % V for d in drafts]  # wrong drafts: the window stops early
        logits = torch.cat([rows[done : done + width], rows[:1]])
        res = sampler(logits, [RowGroup(req, 0, drafts), RowGroup(other, width, [])])
        req.output_token_ids += res[req.request_id].tokens
        done = req.num_output_tokens
    assert req.output_token_ids[:16] == alone.output_token_ids


def test_one_device_sync_per_sampler_call():
    logits = _logits(10).to(DEV)
    groups = lambda: [  # noqa: E731
        RowGroup(make_req(temperature=0.0), 0, []),
        RowGroup(make_req(temperature=0.0, logprobs=2, repetition_penalty=1.2), 1, [3, 4]),
        RowGroup(make_req(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1), 4, [5]),
        RowGroup(make_req(temperature=1.0, frequency_penalty=0.3, min_tokens=3), 6, [1, 2, 3]),
    ]
    sampler = Sampler(0)
    sampler(logits, groups())  # warm-up: lazy CUDA initialisation is not a per-step cost
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler(logits, groups())
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, syncs


def test_engine_runs_every_sampling_feature_on_cuda(tmp_path):
    """End to end on CUDA (torch backend): no feature crashes, n > 1 works, seeds reproduce."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine import LLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, initializer_range=0.2)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "target")
    llm = LLM(model=str(tmp_path / "target"), dtype="bfloat16", device="cuda",
              attention_backend="torch", kv_cache_memory="64MiB", speculative_config=None)
    base = {"max_tokens": 12, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.0, logprobs=3, **base),
        SamplingParams(temperature=0.9, seed=1, **base),
        SamplingParams(temperature=1.0, top_p=0.8, top_k=40, min_p=0.02, seed=2, **base),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.4, seed=3, **base),
        SamplingParams(temperature=1.0, min_tokens=8, seed=4, **base),
        SamplingParams(temperature=1.0, n=2, seed=5, **base),
        SamplingParams(temperature=1.0, logprobs=2, **base),
    ]
    prompts = [[1, 2, 3, 4, 5 + i] for i in range(len(params))]
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    for out, rep, p in zip(first, again, params):
        assert len(out.outputs) == p.n
        assert all(len(c.token_ids) == 12 for c in out.outputs)
        if p.seed is not None or p.temperature == 0:
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in rep.outputs]
        if p.logprobs is not None:
            assert len(out.outputs[0].logprobs) == 12
