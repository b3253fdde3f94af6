"""Build the proposer named by the speculative config."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.spec.base import Proposer
from models.llama import LlamaForCausalLM


def build_proposer(
    config: EngineConfig, target: LlamaForCausalLM, device: torch.device
) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(
            num_speculative_tokens=spec.num_speculative_tokens or 5,
            min_n=spec.prompt_lookup_min,
            max_n=spec.prompt_lookup_max,
        )
    from engine.spec.dflash import DFlashProposer

    return DFlashProposer.create(config, target, device)
