"""The batched, device-side sampler against the per-row sampler it replaced (CPU).

Greedy decisions (with penalties, min_tokens, drafts and logprobs) must be the tokens the old
per-row code picked; seeded sampling must be reproducible and the same alone, in any batch and
under speculation; a call makes one device-to-host transfer.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import Request
from engine.sampler import RowGroup, Sampler
from engine.sampling_params import SamplingParams

EOS = 2
V = 40
_ids = iter(range(10**9))


def make_req(prompt=(10, 11, 12), outputs=(), **params) -> Request:
    params.setdefault("max_tokens", 200)
    req = Request(f"d{next(_ids)}", list(prompt), SamplingParams(**params), (EOS,))
    req.output_token_ids = list(outputs)
    return req


# --------------------------------------------------------------------------- the old per-row code


def _old_process(row: torch.Tensor, req: Request, history: list[int]) -> torch.Tensor:
    params, out = req.params, row
    if len(history) < params.min_tokens:
        out = out.clone()
        banned = list(params.stop_token_ids)
        banned += [] if params.ignore_eos else list(req.eos_token_ids)
        if banned:
            out[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    if params.needs_penalties:
        out = out.clone()
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(history)), dtype=torch.long)
            vals = out[seen]
            out[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                    vals * params.repetition_penalty)
        if history and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(history, dtype=torch.long),
                                    minlength=out.shape[0]).to(out.dtype)
            out -= params.frequency_penalty * counts
            out -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def _old_greedy(logits: torch.Tensor, g: RowGroup):
    req = g.request
    tokens, lps = [], []
    for k in range(len(g.drafts) + 1):
        row = logits[g.start + k]
        tok = int(_old_process(row, req, req.output_token_ids + g.drafts[:k]).argmax())
        tokens.append(tok)
        lp = torch.log_softmax(row, dim=-1)
        n = req.params.logprobs or 0
        top = {}
        if n > 0:
            values, ids = lp.topk(n)
            top = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
        lps.append((tok, float(lp[tok]), top))
        if k >= len(g.drafts) or tok != g.drafts[k]:
            break
    return tokens, len(tokens) - 1, lps


def _random_greedy_group(rng: random.Random, logits: torch.Tensor, start: int) -> RowGroup:
    outputs = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
    params = {"temperature": 0.0}
    if rng.random() < 0.5:
        params["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.5:
        params["frequency_penalty"] = rng.choice([-0.5, 0.4, 1.5])
    if rng.random() < 0.5:
        params["presence_penalty"] = rng.choice([-1.0, 0.3, 2.0])
    if rng.random() < 0.4:
        params["min_tokens"] = rng.randrange(1, 8)
        params["stop_token_ids"] = [rng.randrange(V)]
    if rng.random() < 0.4:
        params["logprobs"] = rng.randrange(0, 4)
    req = make_req(prompt=[rng.randrange(V) for _ in range(4)], outputs=outputs, **params)
    width = rng.randrange(1, 5)
    # drafts: mostly what the old code would pick, sometimes wrong, so windows end anywhere
    drafts = []
    for k in range(width - 1):
        history = req.output_token_ids + drafts
        best = int(_old_process(logits[start + k], req, history).argmax())
        drafts.append(best if rng.random() < 0.75 else rng.randrange(V))
    return RowGroup(req, start, drafts)


@pytest.mark.parametrize("seed", range(12))
def test_greedy_tokens_and_logprobs_equal_the_per_row_sampler(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(60, V, generator=gen) * 3
    logits[:, EOS] += 4  # min_tokens has something to ban
    groups, start = [], 0
    while start < 45:
        g = _random_greedy_group(rng, logits, start)
        groups.append(g)
        start += len(g.drafts) + 1 + rng.randrange(0, 2)  # rows nobody samples in between
    out = Sampler(0)(logits, groups)
    for g in groups:
        tokens, accepted, lps = _old_greedy(logits, g)
        res = out[g.request.request_id]
        assert (res.tokens, res.num_accepted) == (tokens, accepted)
        if g.request.params.logprobs is None:
            assert res.logprobs is None
        else:
            assert [(lp.token_id, lp.logprob, lp.top) for lp in res.logprobs] == lps


# --------------------------------------------------------------------------- seeded determinism


def _decode_alone(params: dict, rows: torch.Tensor, prompt=(10, 11, 12)) -> list[int]:
    req = make_req(prompt=prompt, **params)
    sampler = Sampler(0)
    for row in rows:
        tok = sampler(row[None], [RowGroup(req, 0, [])])[req.request_id].tokens[0]
        req.output_token_ids.append(tok)
    return req.output_token_ids


SEEDED = [
    {"temperature": 1.0, "seed": 5},
    {"temperature": 0.7, "top_p": 0.8, "seed": 6},
    {"temperature": 1.2, "top_k": 5, "min_p": 0.05, "seed": 7},
    {"temperature": 0.9, "frequency_penalty": 0.8, "repetition_penalty": 1.3, "seed": 8,
     "min_tokens": 3},
]


@pytest.mark.parametrize("params", SEEDED, ids=["t1", "top_p", "top_k_min_p", "penalties"])
def test_seeded_request_is_the_same_alone_in_a_batch_and_under_speculation(params) -> None:
    steps = 24
    rows = torch.randn(steps, V, generator=torch.Generator().manual_seed(1)) * 2
    alone = _decode_alone(params, rows)
    assert alone == _decode_alone(params, rows)  # reproducible
    assert len(set(alone)) > 3

    # in a batch with neighbours of every kind and speculative windows with drafts that are
    # sometimes right (accepted) and sometimes wrong (the window stops there)
    rng = random.Random(3)
    req = make_req(**params)
    sampler = Sampler(1234)
    neighbours = [make_req(temperature=1.0), make_req(temperature=0.0),
                  make_req(temperature=0.8, top_p=0.9, seed=99),
                  make_req(temperature=0.0, logprobs=2)]
    while req.num_output_tokens < steps:
        done = req.num_output_tokens
        width = min(rng.randrange(1, 5), steps - done)
        drafts = [alone[done + k] if rng.random() < 0.7 else rng.randrange(V)
                  for k in range(1, width)]
        window = rows[done : done + width]
        parts, groups, start = [], [], 0
        for other in rng.sample(neighbours, rng.randrange(0, len(neighbours) + 1)):
            n = rng.randrange(1, 3)
            parts.append(torch.randn(n, V))
            groups.append(RowGroup(other, start, [rng.randrange(V) for _ in range(n - 1)]))
            start += n
        parts.append(window)
        groups.append(RowGroup(req, start, drafts))
        rng.shuffle(groups)  # group order in the call does not matter either
        res = sampler(torch.cat(parts), groups)[req.request_id]
        req.output_token_ids += res.tokens
        for g in groups:
            if g.request is not req:
                g.request.output_token_ids.clear()
    assert req.output_token_ids[:steps] == alone


def test_seeded_outputs_depend_on_the_seed_only() -> None:
    rows = torch.zeros(30, V)
    a = _decode_alone({"temperature": 1.0, "seed": 1}, rows)
    b = _decode_alone({"temperature": 1.0, "seed": 2}, rows)
    assert a != b


def test_one_host_transfer_per_call(monkeypatch) -> None:
    """Everything stays on the device until one packed transfer (counted through the tensor
    methods that copy to the host)."""
    calls: list[str] = []
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _original=original, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    logits = torch.randn(12, V, generator=torch.Generator().manual_seed(0))
    groups = [
        RowGroup(make_req(temperature=0.0), 0, []),
        RowGroup(make_req(temperature=0.0, logprobs=3, repetition_penalty=1.5), 1, [4, 5]),
        RowGroup(make_req(temperature=0.8, top_k=7, top_p=0.9, min_p=0.01, seed=3), 4, [1, 2]),
        RowGroup(make_req(temperature=1.1, frequency_penalty=0.5, min_tokens=4, outputs=[3]), 7,
                 []),
        RowGroup(make_req(temperature=1.0, presence_penalty=0.5, logprobs=1), 8, [6]),
    ]
    Sampler(0)(logits, groups)
    assert calls == ["tolist"]
