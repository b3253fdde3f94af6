"""Speculative rejection sampling against the distribution a sampled draft was drawn from.

A proposer that samples its drafts (DFlash2's selector: ``d_j ~ q_j(. | d_<j)``) records the
``q`` rows with the drafts (``record``). Verification then runs the standard rule (Leviathan
et al. 2023; Chen et al. 2023): with ``p_j`` the request's sampling distribution at row ``j``
(penalties, temperature, top-k/min-p/top-p applied, history = outputs + ``d_<j``),

    accept d_j        with probability min(1, p_j(d_j) / q_j(d_j)),
    else emit one token from norm(max(p_j - q_j, 0)) and stop;
    if every draft is accepted, emit a bonus token from p_K.

Each emitted token is then distributed exactly as ``p`` (for any ``q``), so the output is the
target's. ``q_j`` is the row the token was drawn from, conditioned on the drafts actually
proposed before it, which is all the rule needs.

The proposal travels with the request: ``record`` keys it by the request object (weakly), the
sampler ``take``-s it when it verifies that request's drafts and uses it only if the drafts are
(a prefix of) the recorded ones; anything stale is dropped. Requests without a recorded
proposal (greedy drafts) are verified by the sampler's usual "sample the target, compare".

Random numbers: one uniform per verified draft and one for the emitted token, from the
request's generator if it is seeded, else the sampler's. (The DFlash2 proposer gives seeded
requests greedy drafts instead, which keeps their output identical with and without
speculation; see ``engine/spec/dflash2.py``.) This path runs row by row on the logits'
device; it is meant for correctness first, not batched like the plain sampler.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from engine.outputs import Logprob
from engine.request import Request


@dataclass
class Proposal:
    """Drafts ``tokens`` (K target ids), their candidate ids ``[K, k]`` and the ``q`` rows
    ``[K, k]`` they were drawn from (on the proposer's device)."""

    tokens: list[int]
    candidates: torch.Tensor
    q: torch.Tensor


_proposals: weakref.WeakKeyDictionary[Request, Proposal] = weakref.WeakKeyDictionary()


def record(req: Request, proposal: Proposal) -> None:
    _proposals[req] = proposal


def discard(req: Request) -> None:
    _proposals.pop(req, None)


def take(req: Request, drafts: list[int]) -> Proposal | None:
    """The recorded proposal of ``req`` if ``drafts`` are its tokens (or a prefix); removes it."""
    prop = _proposals.pop(req, None)
    if prop is None or not drafts or prop.tokens[: len(drafts)] != list(drafts):
        return None
    return prop


def verify(sampler, logits: torch.Tensor, group, proposal: Proposal):
    """Rejection-sample one request's verify window (``group``: a sampler ``RowGroup``)."""
    from engine.sampler import SampleResult, process_logits, probs_from

    req, params = group.request, group.request.params
    dev = logits.device
    gen = req.sampling_generator(dev)
    if gen is None:
        gen = sampler.generator_for(dev)
    drafts = list(group.drafts)
    tokens: list[int] = []
    logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
    accepted = 0
    for j in range(len(drafts) + 1):
        row = logits[group.start + j].float()
        p = probs_from(process_logits(row, req, req.output_token_ids + drafts[:j]), params)
        if j == len(drafts):
            tok = _draw(p, gen)
        else:
            q = torch.zeros_like(p).index_put_(
                (proposal.candidates[j].to(dev),), proposal.q[j].to(dev, torch.float32),
                accumulate=True)
            d = drafts[j]
            u = torch.rand(1, generator=gen, device=dev, dtype=torch.float64)
            rejected = not float(u) * float(q[d]) < float(p[d])
            if rejected:
                residual = (p - q).clamp_min(0)
                tok = _draw(residual if float(residual.sum()) > 0 else p, gen)
            else:
                tok = d
                accepted += 1
        tokens.append(tok)
        if logprobs is not None:
            logprobs.append(_logprob(row, tok, min(params.logprobs, row.shape[-1])))
        if j < len(drafts) and rejected:
            break
    return SampleResult(tokens, accepted, logprobs)


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=gen))


def _logprob(row: torch.Tensor, token: int, top_n: int) -> Logprob:
    lp = torch.log_softmax(row, dim=-1)
    top: dict[int, float] = {}
    if top_n > 0:
        values, ids = lp.topk(top_n)
        top = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
    return Logprob(token_id=token, logprob=float(lp[token]), top=top)
