"""Create and save DFlash and DFlash2 drafts in the reference checkpoint format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.dflash import (
    D2T_KEY,
    MASK_EMBEDDING_FILE,
    MASK_EMBEDDING_KEY,
    DFlashDraftModel,
    default_target_layer_ids,
)
from models.dflash2 import build_draft, draft_config
from models.llama import DecoderConfig


def draft_hf_config(
    target: DecoderConfig,
    num_layers: int,
    block_size: int,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    draft_vocab_size: int | None = None,
    dflash2: dict | None = None,
    refine_passes: int = 0,
    refine_threshold: float = 0.0,
) -> dict:
    """A reference-format draft ``config.json`` sized for ``target``; ``dflash2`` (the keys
    ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``) makes it
    a DFlash2 draft."""
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
    extra = {} if draft_vocab_size is None else {"draft_vocab_size": draft_vocab_size}
    return {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": list(ids), "mask_token_id": mask_token_id,
                          **({"refine_passes": refine_passes} if refine_passes else {}),
                          **({"refine_threshold": refine_threshold} if refine_threshold else {}),
                          **(dflash2 or {})},
        **extra,
    }


def to_reference_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """Split the fused projections back into the reference parameter names."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == MASK_EMBEDDING_KEY:
            continue
        if name == D2T_KEY:
            out[name] = tensor.detach().long().contiguous()
            continue
        t = tensor.detach().float().contiguous()
        if ".qkv_proj." in name:
            q, k, v = t.split([cfg.layer.q_size, cfg.layer.kv_size, cfg.layer.kv_size], dim=0)
            for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = value.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = t.split(cfg.intermediate_size, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t
    return out


def save_draft(model: DFlashDraftModel, hf_config: dict, folder: Path, dtype=torch.bfloat16) -> None:
    """Write ``config.json``, ``model.safetensors`` and (if any) the mask embedding file."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v if k == D2T_KEY else v.to(dtype)
             for k, v in to_reference_state_dict(model).items()}
    save_file(state, str(folder / "model.safetensors"))
    if model.mask_embedding is not None:
        save_file({MASK_EMBEDDING_KEY: model.mask_embedding.detach().to(dtype).contiguous()},
                  str(folder / MASK_EMBEDDING_FILE))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def random_draft(hf_config: dict, seed: int = 0, std: float = 0.02) -> DFlashDraftModel:
    """A draft with random weights (normal ``std``, norms at 1) for tests and baselines."""
    cfg = draft_config(hf_config)
    gen = torch.Generator().manual_seed(seed)
    model = build_draft(cfg, max_positions=cfg.block_size + 8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
