"""Build target models from Hugging Face folders."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from models.hf_folder import ModelConfigError, iter_safetensors, normalize_rope
from models.llama import DecoderConfig, LlamaForCausalLM

# architecture name -> (attention bias, q/k norm)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


class UnsupportedArchitectureError(ValueError):
    """The folder holds a model family this engine does not implement."""


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ModelConfigError("config.json has no 'architectures' list")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"Unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


@contextmanager
def config_errors(what: str = "config.json") -> Iterator[None]:
    """Report a missing or malformed field of ``what`` as a ``ModelConfigError``."""
    try:
        yield
    except ModelConfigError:
        raise
    except KeyError as exc:
        raise ModelConfigError(f"{what} is missing the field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"{what} has a malformed field: {exc}") from exc


def layer_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder fields a Llama-family ``config.json`` (target or DFlash draft) shares:
    sizes, heads, norm epsilon and RoPE. Call inside ``config_errors``."""
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    rope = normalize_rope(hf)
    return {
        "hidden_size": hidden,
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope["rope_theta"],
        "rope_scaling": rope["rope_scaling"],
    }


def decoder_config(hf: dict[str, Any]) -> DecoderConfig:
    arch = architecture_of(hf)
    bias_default, qk_norm = ARCHITECTURES[arch]
    with config_errors():
        cfg = DecoderConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            **layer_fields(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", bias_default)),
            qk_norm=qk_norm,
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelConfigError(
            f"num_attention_heads ({cfg.num_heads}) is not divisible by num_key_value_heads "
            f"({cfg.num_kv_heads})"
        )
    return cfg


def build_target(
    cfg: DecoderConfig, dtype: torch.dtype, max_positions: int, device: torch.device
) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_positions)
    return model.to(dtype=dtype).eval().requires_grad_(False)


LOAD_FORMATS = ("auto", "dummy")


def load_target(
    path: Path,
    hf: dict[str, Any],
    dtype: torch.dtype,
    max_positions: int,
    device: torch.device,
    load_format: str = "auto",
    products: str = "onednn",
) -> LlamaForCausalLM:
    """Build the target and load its safetensors (``dummy``: small random weights instead)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    cfg = decoder_config(hf)
    model = build_target(cfg, dtype, max_positions, device)
    if load_format == "dummy":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    else:
        model.load_weights(iter_safetensors(path))
    model.pack_weights(products=products)
    return model
