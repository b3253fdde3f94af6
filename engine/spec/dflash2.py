"""DFlash2 proposer: the DFlash pass (same context K/V, same draft group and pages), then the
draft's candidate selector chooses the K tokens as a sequence.

Per request, by its sampling parameters:

* greedy requests, and seeded sampled requests: the selector's greedy path. Verification is
  the sampler's usual "sample the target, compare", which is exact for any target
  distribution and keeps a seeded request's output identical with and without speculation
  (it consumes its generator exactly as plain decoding does).
* unseeded sampled requests: the selector samples each token from
  ``q_j = softmax(score_j / T)`` over its candidates (``T``: the request's temperature), from
  this proposer's own generator, and the ``q`` rows are recorded with the drafts; the sampler
  then verifies them by rejection sampling against the request's distribution
  (``engine/spec/rejection.py``), so the output distribution is exactly the target's.
"""

from __future__ import annotations

import torch

from engine.config import ConfigError
from engine.request import Request
from engine.spec import rejection
from engine.spec.base import ProposalItem
from engine.spec.dflash import DFlashProposer


def samples_drafts(req: Request) -> bool:
    """Whether ``req`` gets sampled drafts (with q) rather than the selector's greedy path."""
    return not req.params.greedy and req.params.seed is None


class DFlash2Proposer(DFlashProposer):
    trims_blocks = False  # the selector chooses each block's tokens as a sequence

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg, vocab = self.draft.config, self.target.config.vocab_size
        if cfg.vocab_size != vocab:
            raise ConfigError(
                f"DFlash2 draft vocab_size {cfg.vocab_size} (its selector codebooks) differs from "
                f"the target's {vocab}",
                "speculative_config.model",
            )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def propose(
        self, items: list[ProposalItem], captured: torch.Tensor | None
    ) -> dict[str, list[int]]:
        for it in items:  # a proposal is verified at most once: drop what the last step left
            if it.sampled:
                rejection.discard(it.item.request)
        return super().propose(items, captured)

    def choose(
        self, reqs: list[Request], hidden: torch.Tensor, anchors: torch.Tensor
    ) -> dict[str, list[int]]:
        h = hidden[:, 1:]
        logits = self.draft_logits(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
        temps = [float(r.params.temperature) if samples_drafts(r) else 0.0 for r in reqs]
        temperature = None
        if any(temps):
            temperature = torch.tensor(temps, device=h.device)
        sel = self.draft.candidate_selector.select(
            h, logits, anchors, temperature, self._vocab_ids, self.generator
        )
        tokens = sel.tokens.tolist()
        if sel.q is not None:
            for i, req in enumerate(reqs):
                if temps[i] > 0:
                    rejection.record(req, rejection.Proposal(tokens[i], sel.candidates[i], sel.q[i]))
        return {r.request_id: t for r, t in zip(reqs, tokens)}
