"""The DFlash draft model (reference checkpoint format), a pure function like the target.

The draft has no embedding or LM head of its own. It fuses the target's hidden states at
``target_layer_ids`` (``fc`` then ``hidden_norm``) into a context feature per position; every
draft layer projects that feature with its own ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE) into
context K/V. A query block ``[last token, MASK x K]`` then runs through the Qwen3-style layers
with non-causal attention over the context and the whole block.

Checkpoint: ``config.json`` (``architectures: ["DFlashDraftModel"]``, Qwen3 fields,
``block_size``, ``num_target_layers``, ``dflash_config.{target_layer_ids, mask_token_id}``,
optionally ``dflash_config.refine_passes`` and ``refine_threshold``, see ``DFlashConfig``) and
safetensors with ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``, ``fc``,
``hidden_norm``, ``norm``. A draft may also ship its own mask embedding: a float tensor of shape
``[hidden_size]`` named ``mask_embedding``, in ``mask_embedding.safetensors`` or in the main
weights; when present it replaces the target's embedding row at every MASK slot.

Reduced draft vocabulary (optional): ``config.json`` sets ``draft_vocab_size`` N and the weights
hold ``d2t``, N integer offsets in the EAGLE-3 convention (draft index i stands for target token
``i + d2t[i]``; the ids ascend). The draft then scores only those N rows of the target's frozen
LM head, which for a small target is most of the drafting cost. Proposals stay target ids, and
verification is unchanged, so outputs are exactly the target's whatever the subset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attention.backends.base import AttentionMetadata
from attention.kv import LayerKV, SlotIndex, write_kv
from models.hf_folder import ModelConfigError
from models.layers import Linear, PackedWeight, RMSNorm, RotaryEmbedding, argmax
from models.llama import PACKED, DecoderLayer, LayerSpec, StackShape, WeightLoadError, _copy
from models.loader import config_errors, layer_fields

MASK_EMBEDDING_FILE = "mask_embedding.safetensors"
MASK_EMBEDDING_KEY = "mask_embedding"


def iter_draft_weights(folder) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of a saved draft folder: its weight files, then the mask embedding, which
    saved drafts keep in a file of its own (``load_weights`` takes both)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from models.hf_folder import iter_safetensors

    yield from iter_safetensors(folder)
    mask_file = Path(folder) / MASK_EMBEDDING_FILE
    if mask_file.is_file():
        yield from load_file(str(mask_file)).items()
D2T_KEY = "d2t"
MAX_REFINE = 4  # refinement passes a draft config may ask for (each costs one block pass)


@dataclass(frozen=True)
class DFlashConfig(StackShape):
    attention_bias: bool
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int | None
    num_target_layers: int | None
    draft_vocab_size: int | None = None
    # Refinement passes after the first: each reruns the query block with the previous pass's
    # greedy guesses in place of MASK (the context K/V stay), so a slot sees what the draft
    # expects before it. A property of how the draft was trained (``train_dflash --refine``).
    refine_passes: int = 0
    # A guess replaces MASK only where the draft gives it at least this probability (0: every
    # slot), so a refinement pass is not led by the first pass's unsure guesses.
    refine_threshold: float = 0.0

    @property
    def layer(self) -> LayerSpec:
        """Qwen3-style layers: q/k RMSNorm; ``attention_bias`` puts a bias on every projection."""
        return self.layer_spec(qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                               qk_norm=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DFlashConfig:
        archs = hf.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ModelConfigError(
                f"Draft config.json has architectures {archs}; expected ['DFlashDraftModel']"
            )
        dflash = hf.get("dflash_config") or {}
        _reject_unsupported(hf, dflash)
        with config_errors("Draft config.json"):
            return cls(**draft_fields(hf))


def draft_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields of a DFlash-family draft ``config.json`` (call inside ``config_errors``)."""
    dflash = hf.get("dflash_config") or {}
    fields = layer_fields(hf)
    num_target = hf.get("num_target_layers")
    ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
    if ids is None:
        if num_target is None:
            raise ModelConfigError(
                "Draft config needs dflash_config.target_layer_ids or num_target_layers"
            )
        ids = default_target_layer_ids(int(num_target), fields["num_layers"])
    mask_id = dflash.get("mask_token_id", hf.get("mask_token_id"))
    draft_vocab = hf.get("draft_vocab_size")
    vocab = hf.get("vocab_size")
    if draft_vocab is not None and vocab is not None and int(draft_vocab) == int(vocab):
        draft_vocab = None  # the full vocabulary: no subset
    refine = dflash.get("refine_passes", 0)
    if isinstance(refine, bool) or not isinstance(refine, int) or not 0 <= refine <= MAX_REFINE:
        raise ModelConfigError(f"Draft dflash_config.refine_passes must be an integer in "
                               f"[0, {MAX_REFINE}], got {refine!r}")
    threshold = dflash.get("refine_threshold", 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0.0 <= threshold < 1.0:
        raise ModelConfigError(f"Draft dflash_config.refine_threshold must be a number in "
                               f"[0, 1), got {threshold!r}")
    return {
        **fields,
        "attention_bias": bool(hf.get("attention_bias", False)),
        "block_size": int(dflash.get("block_size", hf.get("block_size", 16))),
        "target_layer_ids": tuple(int(i) for i in ids),
        "mask_token_id": None if mask_id is None else int(mask_id),
        "num_target_layers": None if num_target is None else int(num_target),
        "draft_vocab_size": None if draft_vocab is None else int(draft_vocab),
        "refine_passes": refine,
        "refine_threshold": float(threshold),
    }


def _reject_unsupported(hf: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Refuse draft variants this engine does not implement rather than serve them wrongly."""
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds - {"full_attention"}:
        raise ModelConfigError(
            f"Draft layer_types {sorted(kinds)} are not supported; only full_attention"
        )
    for key, neutral in (("is_causal", None), ("input_embedding_scale", 1.0),
                         ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        value = dflash.get(key, hf.get(key))
        if value is not None and value != neutral and not (key == "is_causal" and value is False):
            raise ModelConfigError(f"Draft option {key}={value!r} is not supported")


def refinement_inputs(logits: torch.Tensor, masks: torch.Tensor, vocab_ids: torch.Tensor | None,
                      embed: Callable[[torch.Tensor], torch.Tensor], threshold: float
                      ) -> torch.Tensor:
    """What a refinement pass sees in a block's drafted slots (training and serving alike):
    the previous pass's greedy guess, embedded, where its probability is at least
    ``threshold`` (every guess at 0), else the slot's first-pass input. ``logits`` ``[..., V']``
    score the draft vocabulary (``vocab_ids`` maps it to target ids; None: all of it),
    ``masks`` ``[..., H]`` are the first-pass inputs, ``embed`` embeds target ids."""
    guess = argmax(logits)
    if vocab_ids is not None:
        guess = vocab_ids[guess]
    fill = embed(guess)
    if threshold > 0:
        sure = logits.float().softmax(-1).amax(-1) >= threshold
        fill = torch.where(sure[..., None], fill, masks)
    return fill


@dataclass(frozen=True)
class BlockRows:
    """The rows of the packed query blocks a pass returns (``DFlashDraftModel.forward``):
    the last layer writes every row's K/V but runs the queries, output projection and MLP of
    these rows alone, so a proposer that needs the states of a block's first few drafts does not
    pay for the rest (each kept row's state is bitwise the whole pass's where attention is
    query-length invariant, as the CPU paged kernel is)."""

    index: torch.Tensor  # [M] long: the kept rows of the packed blocks
    meta: AttentionMetadata  # attention of the kept rows alone (non-causal, the same K/V)
    slots: SlotIndex  # the slot of every block row


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Evenly spaced taps from layer 1 to ``num_target_layers - 3`` (one tap: the middle)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n_taps = len(cfg.target_layer_ids)
        self.fc = Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding: nn.Parameter | None = None
        self.register_buffer("d2t", None)

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}" for i in range(self.config.num_layers)]

    def pack_weights(self, min_rows: int, products: str = "onednn") -> None:
        """Pack every projection for the CPU's GEMM as the target's are (``layers.pack_weight``
        with the target's ``products``; nothing changes elsewhere), padding small products to the
        target's ``min_rows``. For serving only, once the weights are final: the plain weights
        are dropped."""
        for layer in self.layers:
            layer.self_attn.pack_kv(products)  # the context K/V product reads a slice of qkv_proj
        for module in self.modules():
            if isinstance(module, PackedWeight):
                module.pack(products)
                module.min_rows = min_rows

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the reduced draft vocabulary (ascending), or None for the full one."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Context features ``[N, H]`` from concatenated tapped target states ``[N, taps*H]``."""
        return self.hidden_norm(self.fc(target_hidden))

    def write_context(
        self,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_caches: Sequence[LayerKV],
    ) -> None:
        """Store every layer's context K/V for the given positions in the draft's pages."""
        if target_hidden.shape[0] == 0:
            return
        ctx = self.fuse(target_hidden)
        rope = self.rotary.lookup(positions, ctx.dtype)
        # one slot index for all layers: building it looks at the slots (a host sync when they
        # are on the GPU), which must not happen once per layer
        slots = SlotIndex.build(slot_mapping, kv_caches[0].block_size) if kv_caches else None
        for layer, kv in zip(self.layers, kv_caches):
            k, v = layer.self_attn.kv(rope, ctx)
            write_kv(kv, k, v, slots)

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | None,
        kv_caches: Sequence[LayerKV],
        block_len: int | None = None,
        rows: BlockRows | None = None,
    ) -> torch.Tensor:
        """Run query blocks (non-causal metadata) and return the final-normed states, of every
        block row or, with ``rows``, of those rows alone (``meta`` then serves the layers before
        the last, and a one-layer draft needs none). ``block_len`` (the positions per block) is
        only needed by DFlash2 drafts."""
        h = block_embeds
        rope = self.rotary.lookup(positions, h.dtype)
        last = len(self.layers) - 1 if rows is not None else len(self.layers)
        for layer, kv in zip(self.layers[:last], kv_caches):
            h = layer.forward(rope, h, meta, kv)  # (direct calls: see models/llama.py)
        if rows is not None:
            h = self.layers[last].forward_rows(rope, h, rows.index, rows.meta, rows.slots,
                                               kv_caches[last])
        return self.norm(h)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], ignore: Callable[[str], bool] | None = None
    ) -> None:
        """Load reference-format weights; ``ignore`` names parameters a subclass loads itself."""
        params = dict(self.named_parameters())
        cfg, spec = self.config, self.config.layer
        sizes = {"q_proj": (0, spec.q_size), "k_proj": (spec.q_size, spec.kv_size),
                 "v_proj": (spec.q_size + spec.kv_size, spec.kv_size),
                 "gate_proj": (0, cfg.intermediate_size),
                 "up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
        loaded: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == MASK_EMBEDDING_KEY:
                self.set_mask_embedding(tensor)
                continue
            if name == D2T_KEY:
                self.set_d2t(tensor)
                continue
            if name == "t2d":  # EAGLE-3 drafts also store the inverse mask; d2t says it all
                continue
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            target = name
            rows = None
            if len(parts) >= 2 and parts[-2] in PACKED:
                target = ".".join(parts[:-2] + [PACKED[parts[-2]][0], parts[-1]])
                rows = sizes[parts[-2]]
            if target not in params:
                raise WeightLoadError(f"Draft tensor {hf_name!r} has no matching parameter")
            dst = params[target].data
            with torch.no_grad():
                _copy(dst if rows is None else dst[rows[0] : rows[0] + rows[1]], tensor, hf_name)
            loaded[target] = loaded.get(target, 0) + 1
        expected = {n: 3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1 for n in params
                    if n != "mask_embedding" and not (ignore and ignore(n))}
        missing = [n for n, count in expected.items() if loaded.get(n, 0) < count]
        if cfg.draft_vocab_size is not None and self.d2t is None:
            missing.append(D2T_KEY)
        if missing:
            raise WeightLoadError(f"Draft checkpoint is missing weights: {missing[:8]}")

    def set_d2t(self, d2t: torch.Tensor) -> None:
        """Install the reduced-vocabulary offsets (checked: integers, ascending target ids)."""
        n = self.config.draft_vocab_size
        if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise WeightLoadError(f"d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}")
        if n is None or d2t.shape[0] != n:
            raise WeightLoadError(
                f"d2t has {d2t.shape[0]} entries but config.json draft_vocab_size is {n}"
            )
        ids = torch.arange(n) + d2t.long().cpu()
        if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise WeightLoadError("d2t must map draft indices to strictly ascending target ids")
        if int(ids[0]) < 0:
            raise WeightLoadError(f"d2t maps to a negative target id {int(ids[0])}")
        self.d2t = d2t.detach().long().to(self.norm.weight.device)

    def set_mask_embedding(self, vector: torch.Tensor) -> None:
        if tuple(vector.shape) != (self.config.hidden_size,):
            raise WeightLoadError(
                f"mask_embedding has shape {tuple(vector.shape)}, expected ({self.config.hidden_size},)"
            )
        # on the draft's device and dtype: the proposer writes it into every step's block
        weight = self.norm.weight
        self.mask_embedding = nn.Parameter(
            vector.detach().to(device=weight.device, dtype=weight.dtype, copy=True),
            requires_grad=False,
        )
