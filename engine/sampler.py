"""Token sampling and draft verification, on the device of the logits.

Rows of one request are processed in order. For a verify window ``[last, d1..dK]`` row ``k``
is sampled (or argmaxed) with the history the request would have had, drafts ``d1..dk``
included; a draft is accepted while it equals the token sampled at its position. This is
exact for any target distribution when the draft is greedy (sample the target, compare), and
a seeded request consumes its generator exactly as it would without speculation.

Everything runs batched on ``logits.device``: min_tokens bans and penalties are applied to
all rows that need them at once (token counts built there with ``index_add_``), temperature,
top-k, min-p and top-p are per-row tensors over the rows of every sampling request, and a
token is drawn by inverse CDF from one uniform per row. Host data (row indices, parameters,
token histories) goes to the device in pinned, non-blocking copies; the only device-to-host
transfer is one packed tensor at the end (tokens, then logprobs), after which acceptance is
decided on the host.

Random numbers: one uniform (float64) per sampled row. Unseeded rows take theirs from the
sampler's generator on the logits' device, in one call. A seeded request draws from its own
generator (``Request.sampling_generator``, created on the same device) one ``rand(1)`` per row
of its window, in order; once the host knows how many tokens were emitted, the generator is
rewound to the state after that many draws. Draw ``j`` of a seeded request is therefore always
its ``j``-th generated token's, with or without speculation and whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import Logprob
from engine.request import Request
from engine.spec import rejection
from engine.spec.tree import accepted_path, window_depths
from models.layers import argmax


@dataclass
class RowGroup:
    request: Request
    start: int  # first logits row of this request
    drafts: list[int]  # draft tokens verified by rows start+1.. (empty for plain decode)
    # a tree window (engine.spec.tree): parents[j - 1] is the row of draft j's parent; None: a
    # chain (draft j follows draft j - 1)
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Tokens before each row's in the window (row 0: the root)."""
        if self.parents is None:
            return list(range(len(self.drafts) + 1))
        return window_depths(self.parents)

    def history(self, row: int) -> list[int]:
        """The drafts on the way to ``row`` (its ancestors' tokens, root excluded)."""
        if self.parents is None:
            return self.drafts[:row]
        out = []
        while row:
            out.append(self.drafts[row - 1])
            row = self.parents[row - 1]
        return out[::-1]


@dataclass
class SampleResult:
    tokens: list[int]
    num_accepted: int
    logprobs: list[Logprob] | None
    path: list[int] | None = None  # a tree window's accepted rows (1-based), in depth order


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded requests on ``device`` (seeded with the engine seed)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, groups: list[RowGroup]) -> dict[str, SampleResult]:
        if not groups:
            return {}
        proposed = {id(g): p for g in groups if g.drafts and not g.request.params.greedy
                    and g.parents is None
                    and (p := rejection.take(g.request, g.drafts)) is not None}
        if proposed:  # drafts sampled from a recorded q (DFlash2): engine/spec/rejection.py
            out = {g.request.request_id: rejection.verify(self, logits, g, proposed[id(g)])
                   for g in groups if id(g) in proposed}
            return {**self(logits, [g for g in groups if id(g) not in proposed]), **out}
        dev = logits.device
        vocab = logits.shape[-1]
        plan = _HostPlan(groups, vocab)

        # rows of the groups, in group order, as one matrix [R, V]: float32 where anything
        # but the argmax reads them (greedy rows alone take it in the model's dtype: the same
        # indices, without a copy of every score)
        if plan.source_rows == list(range(logits.shape[0])):
            raw = logits
        else:
            raw = logits.index_select(0, _to_device(plan.source_rows, torch.long, dev))
        if plan.ban_flat or plan.pen_rows or plan.sample_rows or plan.lp_rows:
            raw = raw.float()

        proc = raw
        if plan.ban_flat or plan.pen_rows:
            proc = raw.clone()
        if plan.ban_flat:
            proc.view(-1).index_fill_(0, _to_device(plan.ban_flat, torch.long, dev), float("-inf"))
        if plan.pen_rows:
            _apply_penalties(proc, plan, vocab)

        tokens = argmax(proc)
        if plan.sample_rows:
            s_idx = _to_device(plan.sample_rows, torch.long, dev)
            params = _to_device(plan.sample_params, torch.float32, dev).view(-1, 4)
            top_k = _to_device(plan.sample_top_k, torch.long, dev)
            probs = _truncated_probs(
                proc.index_select(0, s_idx), params[:, 0], top_k, params[:, 1], params[:, 2],
                max_k=max(plan.sample_top_k),
                top_p=any(p < 1.0 for p in plan.sample_params[1::4]),
                min_p=any(p > 0.0 for p in plan.sample_params[2::4]),
            )
            uniforms, states = self._draw(plan, dev)
            if plan.sample_draw is not None:  # tree windows: a row uses its depth's draw
                uniforms = uniforms.index_select(0, _to_device(plan.sample_draw, torch.long, dev))
            tokens.index_copy_(0, s_idx, _inverse_cdf(probs, uniforms))
        else:
            states = {}

        parts = [tokens.double()]
        top_n = max((n for n in plan.lp_top.values()), default=0)
        if plan.lp_rows:
            l_idx = _to_device(plan.lp_rows, torch.long, dev)
            lp = torch.log_softmax(raw.index_select(0, l_idx), dim=-1)
            parts.append(lp.gather(1, tokens.index_select(0, l_idx)[:, None]).squeeze(1).double())
            if top_n > 0:
                values, ids = lp.topk(top_n, dim=-1)
                parts += [values.double().flatten(), ids.double().flatten()]
        host = torch.cat(parts).tolist()  # the one device-to-host transfer of the step
        return self._results(plan, host, top_n, states)

    # -- random numbers ------------------------------------------------------------------------
    def _draw(self, plan: _HostPlan, dev: torch.device) -> tuple[torch.Tensor, dict]:
        """One uniform per sampled row (in sampled-row order) and, per seeded group with a
        window of several rows, the generator states before each of its draws after the first."""
        pieces: list[torch.Tensor] = []
        states: dict[int, tuple[torch.Generator, list[torch.Tensor]]] = {}
        unseeded = None
        taken = 0
        for gi, count in plan.sample_spans:
            req = plan.groups[gi].request
            gen = req.sampling_generator(dev)
            if gen is None:
                if unseeded is None:
                    unseeded = torch.rand(plan.num_unseeded, generator=self.generator_for(dev),
                                          device=dev, dtype=torch.float64)
                pieces.append(unseeded[taken : taken + count])
                taken += count
                continue
            saved = []
            for k in range(count):
                if k:
                    saved.append(gen.get_state())
                pieces.append(torch.rand(1, generator=gen, device=dev, dtype=torch.float64))
            if saved:
                states[gi] = (gen, saved)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), states

    # -- results ---------------------------------------------------------------------------------
    def _results(self, plan: _HostPlan, host: list[float], top_n: int,
                 states: dict) -> dict[str, SampleResult]:
        rows = len(plan.source_rows)
        tokens = [int(t) for t in host[:rows]]
        nl = len(plan.lp_rows)
        chosen = host[rows : rows + nl]
        top_vals = host[rows + nl : rows + nl + nl * top_n]
        top_ids = host[rows + nl + nl * top_n :]
        lp_pos = {r: i for i, r in enumerate(plan.lp_rows)}
        results: dict[str, SampleResult] = {}
        for gi, g in enumerate(plan.groups):
            first = plan.group_row[gi]
            window = tokens[first : first + len(g.drafts) + 1]
            path = accepted_path(g.parents, g.drafts, window)
            n = len(path)
            rows = [0, *path]  # the rows whose tokens are emitted, root first
            emitted = [window[r] for r in rows]
            if gi in states and n < len(states[gi][1]):
                gen, saved = states[gi]
                gen.set_state(saved[n])  # as if only n + 1 rows had been drawn
            logprobs = None
            if gi in plan.lp_top:
                logprobs = []
                want = plan.lp_top[gi]
                for r, tok in zip(rows, emitted):
                    i = lp_pos[first + r]
                    base = i * top_n
                    top = {int(top_ids[base + j]): top_vals[base + j] for j in range(want)}
                    logprobs.append(Logprob(token_id=tok, logprob=chosen[i], top=top))
            results[g.request.request_id] = SampleResult(
                emitted, n, logprobs, path if g.parents is not None else None)
        return results


class _HostPlan:
    """Host-side description of one sampling call: plain lists, copied to the device once."""

    def __init__(self, groups: list[RowGroup], vocab: int) -> None:
        self.groups = groups
        self.source_rows: list[int] = []
        self.group_row: list[int] = []  # first compact row of each group
        self.ban_flat: list[int] = []  # row * vocab + token, set to -inf
        # penalties: compact rows, their penalty group, per-row factors, token counts
        self.pen_rows: list[int] = []
        self.pen_group: list[int] = []
        self.pen_factors: list[float] = []  # (repetition, frequency, presence) per row
        self.pen_output_flat: list[int] = []  # penalty group * vocab + output token
        self.pen_prompt_flat: list[int] = []  # penalty group * vocab + prompt token (set)
        self.pen_draft_flat: list[int] = []  # penalty row * vocab + earlier draft token
        self.num_pen_groups = 0
        # sampling (non-greedy) rows
        self.sample_rows: list[int] = []
        # per sampled row, which of the drawn uniforms it uses (None: one draw per row, in
        # order); rows of a tree window at one depth share that depth's draw, so draw j is
        # always the request's j-th token's, as without speculation
        self.sample_draw: list[int] | None = None
        self.sample_params: list[float] = []  # (temperature, top_p, min_p, 0) per row
        self.sample_top_k: list[int] = []  # 0 = off
        self.sample_spans: list[tuple[int, int]] = []  # (group, rows) in sampled-row order
        self.num_unseeded = 0
        # logprobs
        self.lp_rows: list[int] = []
        self.lp_top: dict[int, int] = {}  # group -> top-N
        draws = 0  # uniforms drawn so far (in sample_spans order)
        for gi, g in enumerate(groups):
            req, params = g.request, g.request.params
            width = len(g.drafts) + 1
            depths = g.depths()
            first = len(self.source_rows)
            self.group_row.append(first)
            self.source_rows.extend(range(g.start, g.start + width))
            done = req.num_output_tokens
            if done < params.min_tokens:
                banned = list(params.stop_token_ids)
                if not params.ignore_eos:
                    banned += list(req.eos_token_ids)
                for k in range(width):
                    if done + depths[k] < params.min_tokens:
                        self.ban_flat.extend((first + k) * vocab + t for t in banned)
            if params.needs_penalties:
                pg = self.num_pen_groups
                self.num_pen_groups += 1
                self.pen_output_flat.extend(pg * vocab + t for t in req.output_token_ids)
                if params.repetition_penalty != 1.0:
                    self.pen_prompt_flat.extend(pg * vocab + t for t in set(req.prompt_token_ids))
                for k in range(width):
                    pr = len(self.pen_rows)
                    self.pen_rows.append(first + k)
                    self.pen_group.append(pg)
                    self.pen_factors += [params.repetition_penalty, params.frequency_penalty,
                                         params.presence_penalty]
                    self.pen_draft_flat.extend(pr * vocab + t for t in g.history(k))
            if not params.greedy:
                self.sample_rows.extend(range(first, first + width))
                k = params.top_k if 0 < params.top_k < vocab else 0
                for _ in range(width):
                    self.sample_params += [params.temperature, params.top_p, params.min_p, 0.0]
                    self.sample_top_k.append(k)
                count = max(depths) + 1
                if g.parents is not None and self.sample_draw is None:
                    self.sample_draw = list(range(len(self.sample_rows) - width))
                if self.sample_draw is not None:
                    self.sample_draw.extend(draws + d for d in depths)
                draws += count
                self.sample_spans.append((gi, count))
                if params.seed is None:
                    self.num_unseeded += count
            if params.logprobs is not None:
                self.lp_rows.extend(range(first, first + width))
                self.lp_top[gi] = min(params.logprobs, vocab)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``: pinned and non-blocking on CUDA (no host sync)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _apply_penalties(proc: torch.Tensor, plan: _HostPlan, vocab: int) -> None:
    """Repetition (prompt + history), frequency and presence (history) penalties, in place on
    the penalty rows of ``proc``; history = output tokens + the drafts before the row."""
    dev = proc.device
    rows = _to_device(plan.pen_rows, torch.long, dev)
    groups = _to_device(plan.pen_group, torch.long, dev)
    factors = _to_device(plan.pen_factors, torch.float32, dev).view(-1, 3)
    counts = torch.zeros(plan.num_pen_groups * vocab, dtype=torch.float32, device=dev)
    if plan.pen_output_flat:
        idx = _to_device(plan.pen_output_flat, torch.long, dev)
        counts.index_add_(0, idx, torch.ones(idx.shape[0], dtype=torch.float32, device=dev))
    counts = counts.view(-1, vocab).index_select(0, groups)
    if plan.pen_draft_flat:
        idx = _to_device(plan.pen_draft_flat, torch.long, dev)
        ones = torch.ones(idx.shape[0], dtype=torch.float32, device=dev)
        counts.view(-1).index_add_(0, idx, ones)
    sub = proc.index_select(0, rows)
    rep, freq, pres = factors[:, 0:1], factors[:, 1:2], factors[:, 2:3]
    if any(f != 1.0 for f in plan.pen_factors[0::3]):
        prompt = torch.zeros(plan.num_pen_groups * vocab, dtype=torch.bool, device=dev)
        if plan.pen_prompt_flat:
            prompt.index_fill_(0, _to_device(plan.pen_prompt_flat, torch.long, dev), True)
        seen = prompt.view(-1, vocab).index_select(0, groups) | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(f != 0.0 for i, f in enumerate(plan.pen_factors) if i % 3):
        sub = sub - freq * counts
        sub = sub - pres * (counts > 0).to(sub.dtype)
    proc.index_copy_(0, rows, sub)


def _truncated_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p_v: torch.Tensor,
    min_p_v: torch.Tensor, max_k: int, top_p: bool, min_p: bool,
) -> torch.Tensor:
    """Unnormalised sampling probabilities ``[S, V]`` in vocabulary order: temperature, top-k
    (ties with the k-th score kept), softmax, min-p, then top-p (smallest prefix of the sorted
    distribution reaching ``top_p``). Every step is per row, so a row's result never depends on
    the other rows. ``max_k``/``top_p``/``min_p`` say (from host data) whether any row needs it."""
    scores = logits / temperature[:, None]
    if max_k > 0:
        kth = scores.topk(max_k, dim=-1).values.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if min_p:
        probs = probs.masked_fill(probs < min_p_v[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    if top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        cum = sorted_probs.cumsum(dim=-1)
        drop = (cum - sorted_probs) >= top_p_v[:, None] * cum[:, -1:]
        drop &= (top_p_v < 1.0)[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token per row: the first index whose cumulative mass exceeds ``u * total`` (float64)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    ok = probs.gather(1, idx[:, None]).squeeze(1) > 0
    return torch.where(ok, idx, probs.argmax(dim=-1))


# -- one-row helpers (the batched code on a single row; used by tests and tools) ---------------


def process_logits(row: torch.Tensor, req: Request, history: list[int]) -> torch.Tensor:
    """min_tokens masking and penalties for one row of float32 logits, where ``history`` is
    the request's output so far followed by the drafts before this row."""
    outputs = req.output_token_ids
    drafts = history[len(outputs):] if history[: len(outputs)] == outputs else None
    if drafts is None:  # an arbitrary history: treat it all as output
        shadow = Request(req.request_id, req.prompt_token_ids, req.params, req.eos_token_ids)
        shadow.output_token_ids = list(history)
        req, drafts = shadow, []
    # a window whose last row follows ``drafts``: only that row is returned
    logits = row[None].expand(len(drafts) + 1, -1)
    plan = _HostPlan([RowGroup(req, 0, list(drafts))], row.shape[-1])
    proc = logits.float().clone()
    if plan.ban_flat:
        proc.view(-1).index_fill_(0, _to_device(plan.ban_flat, torch.long, proc.device),
                                  float("-inf"))
    if plan.pen_rows:
        _apply_penalties(proc, plan, row.shape[-1])
    return proc[-1]


def probs_from(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, top-k, min-p and top-p, then normalised: the distribution one row of
    ``logits`` is sampled from."""
    vocab = logits.shape[-1]
    dev = logits.device
    k = params.top_k if 0 < params.top_k < vocab else 0
    probs = _truncated_probs(
        logits.float()[None], torch.tensor([params.temperature], device=dev),
        torch.tensor([k], device=dev), torch.tensor([params.top_p], device=dev),
        torch.tensor([params.min_p], device=dev), max_k=k, top_p=params.top_p < 1.0,
        min_p=params.min_p > 0,
    )[0]
    return probs / probs.sum()
