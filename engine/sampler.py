"""Token sampling and draft verification.

Rows of one request are processed in order. For a verify window ``[last, d1..dK]`` row ``k``
is sampled (or argmaxed) with the history the request would have had, drafts ``d1..dk``
included; a draft is accepted while it equals the token sampled at its position. This is
exact for any target distribution when the draft is greedy (sample the target, compare), and
a seeded request consumes its generator exactly as it would without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import Logprob
from engine.request import Request


@dataclass
class RowGroup:
    request: Request
    start: int  # first logits row of this request
    drafts: list[int]  # draft tokens verified by rows start+1.. (empty for plain decode)


@dataclass
class SampleResult:
    tokens: list[int]
    num_accepted: int
    logprobs: list[Logprob] | None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, groups: list[RowGroup]) -> dict[str, SampleResult]:
        results: dict[str, SampleResult] = {}
        fast = [g for g in groups if _is_plain_greedy(g.request)]
        if fast:
            rows = torch.cat([
                torch.arange(g.start, g.start + len(g.drafts) + 1) for g in fast
            ])
            argmax = logits.index_select(0, rows).argmax(dim=-1).tolist()
            pos = 0
            for g in fast:
                n = len(g.drafts) + 1
                results[g.request.request_id] = _accept(argmax[pos : pos + n], g.drafts)
                pos += n
        for g in groups:
            if not _is_plain_greedy(g.request):
                results[g.request.request_id] = self._sample_group(logits, g)
        return results

    def _sample_group(self, logits: torch.Tensor, g: RowGroup) -> SampleResult:
        req, params = g.request, g.request.params
        gen = req.generator if req.generator is not None else self.generator
        tokens: list[int] = []
        logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        for k in range(len(g.drafts) + 1):
            row = logits[g.start + k]
            history = req.output_token_ids + g.drafts[:k]
            processed = process_logits(row, req, history)
            if params.greedy:
                tok = int(processed.argmax())
            else:
                tok = int(torch.multinomial(probs_from(processed, params), 1, generator=gen))
            tokens.append(tok)
            if logprobs is not None:
                logprobs.append(_logprob(row, tok, params.logprobs))
            if k >= len(g.drafts) or tok != g.drafts[k]:
                break
        return SampleResult(tokens, len(tokens) - 1, logprobs)


def _is_plain_greedy(req: Request) -> bool:
    p = req.params
    return (p.greedy and p.logprobs is None and not p.needs_penalties
            and req.num_output_tokens >= p.min_tokens)


def _accept(targets: list[int], drafts: list[int]) -> SampleResult:
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return SampleResult(targets[: n + 1], n, None)


def process_logits(row: torch.Tensor, req: Request, history: list[int]) -> torch.Tensor:
    """Apply min_tokens masking and penalties to one row of float32 logits."""
    params = req.params
    out = row
    if len(history) < params.min_tokens:
        out = out.clone()
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(req.eos_token_ids))
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


def probs_from(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p, then softmax."""
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        drop = (cum - sorted_probs) >= params.top_p * cum[-1]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


def _logprob(row: torch.Tensor, token: int, top_n: int) -> Logprob:
    lp = torch.log_softmax(row, dim=-1)
    top: dict[int, float] = {}
    if top_n > 0:
        values, ids = lp.topk(top_n)
        top = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
    return Logprob(token_id=token, logprob=float(lp[token]), top=top)
