"""Megatron-style tensor-parallel sharding of the Llama-family decoder.

Rank ``r`` of ``N`` holds, per layer:
- ``qkv_proj`` column-parallel: its ``num_heads / N`` query heads and their KV heads (``K / N``
  of them; when the model has fewer KV heads than ranks, each rank holds the one KV head its
  query heads read, replicated on ``N / K`` ranks);
- ``gate_up_proj`` column-parallel: ``intermediate_size / N`` channels of gate and of up;
- ``o_proj`` and ``down_proj`` row-parallel: the matching input columns, followed by one
  all-reduce (sum) each, so every rank holds the complete hidden states after every layer;
- the embedding, norms and LM head replicated (the engine's rank 0 computes the logits).

A shard is an ordinary ``LlamaForCausalLM`` built from the per-rank ``DecoderConfig``
(``local_config``) whose ``o_proj``/``down_proj`` are swapped for ``RowParallelLinear``; its
weights are read slice by slice from the same safetensors folder (``iter_shard_weights``), so
no rank reads the full projection matrices. This module knows nothing about processes: the
all-reduce is a callable handed in by the engine.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.hf_folder import ModelConfigError, weight_files
from models.layers import PackedWeight, linear
from models.llama import DecoderConfig, LlamaForCausalLM
from models.loader import LOAD_FORMATS, build_target, decoder_config

AllReduce = Callable[[torch.Tensor], None]  # in-place sum over all ranks


def _problems(cfg: DecoderConfig, size: int) -> list[str]:
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads ({cfg.num_heads}) is not divisible by {size}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        problems.append(
            f"num_key_value_heads ({kv}) neither divides by {size} nor divides {size} "
            "(KV heads are split across ranks, or replicated when there are fewer than ranks)"
        )
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size ({cfg.intermediate_size}) is not divisible by {size}")
    return problems


def tensor_parallel_error(cfg: DecoderConfig, size: int) -> str | None:
    """Why ``cfg`` cannot be split ``size`` ways (``None`` if it can)."""
    if size < 1:
        return f"tensor_parallel_size must be >= 1, got {size}"
    problems = _problems(cfg, size)
    if not problems:
        return None
    valid = [n for n in range(1, cfg.num_heads + 1) if not _problems(cfg, n)]
    return (
        f"tensor_parallel_size {size} does not fit this model: {'; '.join(problems)}. "
        f"Valid sizes for it: {', '.join(map(str, valid))}"
    )


def local_config(cfg: DecoderConfig, size: int) -> DecoderConfig:
    """The decoder shape one rank of ``size`` holds."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
    )


def shard_slice(
    hf_name: str, cfg: DecoderConfig, rank: int, size: int
) -> tuple[int, int, int] | None:
    """``(dim, start, length)`` of the checkpoint tensor ``hf_name`` that ``rank`` holds, or
    ``None`` for a replicated tensor."""
    parts = hf_name.split(".")
    if len(parts) < 2:
        return None
    proj, kind = parts[-2], parts[-1]
    d = cfg.head_dim
    q_local = cfg.num_heads // size * d
    i_local = cfg.intermediate_size // size
    if proj == "q_proj":
        return 0, rank * q_local, q_local
    if proj in ("k_proj", "v_proj"):
        if cfg.num_kv_heads >= size:
            kv_local = cfg.num_kv_heads // size * d
            return 0, rank * kv_local, kv_local
        head = rank // (size // cfg.num_kv_heads)  # the KV head this rank's query heads read
        return 0, head * d, d
    if proj == "o_proj" and kind == "weight":
        return 1, rank * q_local, q_local
    if proj in ("gate_proj", "up_proj"):
        return 0, rank * i_local, i_local
    if proj == "down_proj" and kind == "weight":
        return 1, rank * i_local, i_local
    if proj in ("o_proj", "down_proj"):
        raise ModelConfigError(f"{hf_name}: biases of row-parallel projections are not supported")
    return None


def iter_shard_weights(
    path: Path | str, cfg: DecoderConfig, rank: int, size: int, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` with only ``rank``'s slice of every sharded tensor read from
    disk (safetensors slices); tensors named in ``skip`` are not read."""
    from safetensors import SafetensorError, safe_open

    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if name in skip:
                        continue
                    rule = shard_slice(name, cfg, rank, size)
                    if rule is None:
                        yield name, handle.get_tensor(name)
                        continue
                    dim, start, length = rule
                    part = handle.get_slice(name)
                    yield name, (part[start : start + length] if dim == 0
                                 else part[:, start : start + length])
        except SafetensorError as exc:
            raise ModelConfigError(f"Cannot read weights from {file}: {exc}") from exc


class RowParallelLinear(PackedWeight, nn.Module):
    """``x @ W_shard.T`` summed over ranks (one all-reduce); keeps the ``weight`` name."""

    def __init__(self, weight: nn.Parameter, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = weight
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, packed=self.packed, min_rows=self.min_rows)
        self.all_reduce(out)
        return out


def build_target_shard(
    cfg: DecoderConfig, rank: int, size: int, dtype: torch.dtype, max_positions: int,
    device: torch.device, all_reduce: AllReduce,
) -> LlamaForCausalLM:
    model = build_target(local_config(cfg, size), dtype, max_positions, device)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.o_proj.bias is not None:  # the Llama family's targets have none
            raise ModelConfigError("row-parallel o_proj with a bias is not supported")
        attn.o_proj = RowParallelLinear(attn.o_proj.weight, all_reduce)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, all_reduce)
    return model


def load_target_shard(
    path: Path, hf: dict[str, Any], dtype: torch.dtype, max_positions: int, device: torch.device,
    load_format: str, rank: int, size: int, all_reduce: AllReduce, with_lm_head: bool = True,
    products: str = "onednn",
) -> LlamaForCausalLM:
    """Rank ``rank``'s shard of the target, its weights read slice by slice (``dummy``: random
    weights, identical on every rank for the replicated tensors). ``with_lm_head=False`` (the
    workers, which never compute logits) drops an untied LM head."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    cfg = decoder_config(hf)
    problem = tensor_parallel_error(cfg, size)
    if problem is not None:
        raise ModelConfigError(problem)
    model = build_target_shard(cfg, rank, size, dtype, max_positions, device, all_reduce)
    skip: frozenset[str] = frozenset()
    if not with_lm_head and model.lm_head is not None:
        model.lm_head = None  # lm_head_weight now names the embedding: never used here
        skip = frozenset({"lm_head.weight"})
    if load_format == "dummy":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
                if not any(k in name for k in ("proj",)):  # replicated: the same on every rank
                    g.manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    else:
        model.load_weights(iter_shard_weights(path, cfg, rank, size, skip))
    model.pack_weights(head=with_lm_head, products=products)  # workers never compute logits
    return model
