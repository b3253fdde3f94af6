"""DFlash2 drafts (reference checkpoint format): DFlash plus block convolutions and a selector.

Two additions to the DFlash draft (``models/dflash.py``), both acting on the query block only:

* Every layer wraps its attention and its MLP in a **grouped dynamic causal convolution**.
  From the layer's normed input ``x`` (one block ``[L, H]``), ``kernel_projection`` gives two
  per-token kernels ``[2, K, G]`` (``K = conv_kernel_size`` offsets, ``G = H / conv_group_size``
  channel groups). Before the sublayer, ``x`` is convolved with the first; after it, the
  sublayer's output with the second:

      y[t, c] = sum_{o < K} (base[o, c] + dyn[t, o, group(c)]) * x[t - o, c]   (x[<0] = 0)

  ``base_kernel`` ``[2, K, H]`` is a learned per-channel kernel for each side. The
  convolution runs over the positions of one query block ``[anchor, MASK x k]``: its window
  starts at the anchor with zeros before it, and never reaches the context or an earlier
  step's block. The context K/V (fused target features through ``k_proj``/``v_proj``) are
  the DFlash ones, untouched by it. So a DFlash2 draft needs exactly the DFlash draft's cache
  (context K/V in the draft's own pages plus the block's look-ahead slots, overwritten every
  step) and nothing more; ``tests/spec/test_spec_dflash2_parity.py`` checks the cached
  multi-step loop against the reference.

* A **candidate selector** chooses the proposed tokens as a sequence. Per block position it
  keeps the ``selector_top_k`` best tokens of the draft logits (the *unary* scores) and, left
  to right, rescores them with a rank-``selector_rank`` bilinear term between the previous
  chosen token (the anchor for the first position) and each candidate, gated by the
  position's hidden state:

      score_j(c) = logit_j(c) + sum_r P[prev, r] * (W h_j)[r] * S[c, r]

  ``P``/``S`` are the predecessor/successor codebooks ``[vocab_size, r]`` (indexed by target
  token id) and ``W`` is ``hidden_projection``. Greedy drafting takes the argmax at each
  position; sampled drafting draws from ``q_j = softmax(score_j / T)`` over the candidates and
  keeps ``q_j`` so that verification can rejection-sample against it (``engine/spec/
  rejection.py``).

Checkpoint: the DFlash files plus ``layers.{i}.{attention,mlp}_conv.base_kernel``,
``layers.{i}.{attention,mlp}_conv.kernel_projection.weight`` and
``candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection}.weight``.
The reference's ``from_pretrained`` maps bare ``candidate_selector.*_codebook`` keys to
``...codebook.weight``; both spellings load. ``config.json``: ``architectures:
["DFlash2DraftModel"]``, ``vocab_size`` and ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k`` (in ``dflash_config`` or at the top level, like the
other DFlash keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attention.backends.base import AttentionMetadata
from attention.kv import LayerKV
from models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    _reject_unsupported,
    draft_fields,
)
from models.hf_folder import ModelConfigError
from models.layers import Rope
from models.llama import DecoderLayer, LayerSpec, WeightLoadError, _copy
from models.loader import config_errors

ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# bare codebook names (as the reference's from_pretrained key_mapping reads them) -> ours
CODEBOOK_KEYS = {f"candidate_selector.{n}": f"candidate_selector.{n}.weight"
                 for n in ("predecessor_codebook", "successor_codebook")}


def is_dflash2(hf: dict[str, Any]) -> bool:
    """Whether a draft ``config.json`` describes a DFlash2 draft (by architecture or keys)."""
    if ARCHITECTURE in (hf.get("architectures") or []):
        return True
    dflash = hf.get("dflash_config") or {}
    return any(k in dflash or k in hf for k in DFLASH2_KEYS)


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    vocab_size: int = 0
    conv_kernel_size: int = 1
    conv_group_size: int = 1
    selector_rank: int = 1
    selector_top_k: int = 1

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DFlash2Config:
        archs = hf.get("architectures") or []
        if not is_dflash2(hf) or "DFlashDraftModel" in archs:
            raise ModelConfigError(
                f"Draft config.json has architectures {archs}; expected ['{ARCHITECTURE}'] "
                f"with {', '.join(DFLASH2_KEYS)}"
            )
        dflash = hf.get("dflash_config") or {}
        _reject_unsupported(hf, dflash)

        def value(name: str) -> int:
            v = dflash.get(name, hf.get(name))
            if v is None:
                raise KeyError(name)
            return int(v)

        with config_errors("Draft config.json"):
            cfg = cls(**draft_fields(hf), vocab_size=int(hf["vocab_size"]),
                      **{k: value(k) for k in DFLASH2_KEYS})
        if cfg.conv_kernel_size < 1 or cfg.conv_group_size < 1 \
                or cfg.hidden_size % cfg.conv_group_size:
            raise ModelConfigError(
                f"Draft conv_kernel_size {cfg.conv_kernel_size} must be >= 1 and "
                f"conv_group_size {cfg.conv_group_size} must divide hidden_size {cfg.hidden_size}"
            )
        limit = cfg.draft_vocab_size or cfg.vocab_size
        if cfg.selector_rank < 1 or not 1 <= cfg.selector_top_k <= limit:
            raise ModelConfigError(
                f"Draft selector_rank {cfg.selector_rank} must be >= 1 and selector_top_k "
                f"{cfg.selector_top_k} in [1, {limit}] (the draft's vocabulary)"
            )
        return cfg


def draft_config(hf: dict[str, Any]) -> DFlashConfig:
    """The config of a DFlash or a DFlash2 draft, told apart by ``config.json``."""
    return DFlash2Config.from_hf(hf) if is_dflash2(hf) else DFlashConfig.from_hf(hf)


def build_draft(cfg: DFlashConfig, max_positions: int) -> DFlashDraftModel:
    cls = DFlash2DraftModel if isinstance(cfg, DFlash2Config) else DFlashDraftModel
    return cls(cfg, max_positions)


# --------------------------------------------------------------------------- convolution


def block_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Causal convolution within each block: ``x`` ``[n, L, H]``, per-token group kernels
    ``dynamic`` ``[n, L, K, G]``, per-channel kernel ``base`` ``[K, H]``; returns ``[n, L, H]``
    with ``y[t] = sum_o (base[o] + dynamic[t, o]) * x[t - o]`` (zeros before the block)."""
    n, length, hidden = x.shape
    k, groups = dynamic.shape[-2:]
    xg = x.view(n, length, groups, hidden // groups)
    base = base.to(x.dtype).view(k, groups, hidden // groups)
    out = None
    for o in range(min(k, length)):
        shifted = xg if o == 0 else F.pad(xg[:, : length - o], (0, 0, 0, 0, o, 0))
        term = (base[o] + dynamic[:, :, o, :, None]) * shifted
        out = term if out is None else out + term
    return out.view(n, length, hidden)


class BlockConv(nn.Module):
    """The two grouped dynamic causal convolutions around one sublayer (before and after)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def around(self, sublayer, x: torch.Tensor, block_len: int) -> torch.Tensor:
        """``conv_after(sublayer(conv_before(x)))`` for ``x`` ``[n * block_len, H]``."""
        blocks = x.view(-1, block_len, x.shape[-1])
        dyn = self.kernel_projection(blocks).view(*blocks.shape[:2], 2, self.kernel_size, self.groups)
        inner = block_conv(blocks, dyn[:, :, 0], self.base_kernel[0]).view_as(x)
        out = sublayer(inner).view_as(blocks)
        return block_conv(out, dyn[:, :, 1], self.base_kernel[1]).view_as(x)


class DFlash2Layer(DecoderLayer):
    def __init__(self, spec: LayerSpec, kernel_size: int, group_size: int) -> None:
        super().__init__(spec)
        self.attention_conv = BlockConv(spec.hidden_size, kernel_size, group_size)
        self.mlp_conv = BlockConv(spec.hidden_size, kernel_size, group_size)

    def forward(
        self, rope: Rope, h: torch.Tensor, meta: AttentionMetadata, kv: LayerKV, block_len: int
    ) -> torch.Tensor:
        attn = lambda x: self.self_attn(rope, x, meta, kv)  # noqa: E731
        h = h + self.attention_conv.around(attn, self.input_layernorm(h), block_len)
        return h + self.mlp_conv.around(self.mlp, self.post_attention_layernorm(h), block_len)


# --------------------------------------------------------------------------- selector


@dataclass
class Selection:
    """Proposed target ids ``[n, L]``, the candidates ``[n, L, k]`` (target ids) and, for
    sampled rows, the distribution ``q`` ``[n, L, k]`` each token was drawn from (float32; rows
    of greedy requests are one-hot at the argmax)."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    q: torch.Tensor | None


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(
        self, logits: torch.Tensor, vocab_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unary scores and target ids ``[..., k]`` of the top-k of the draft logits."""
        unary, idx = logits.float().topk(self.top_k, dim=-1)
        return unary, idx if vocab_ids is None else vocab_ids[idx]

    def pair_scores(
        self, prev: torch.Tensor, gate: torch.Tensor, cands: torch.Tensor
    ) -> torch.Tensor:
        """The codebook term ``[..., k]`` for predecessors ``prev`` ``[...]``, projected hidden
        ``gate`` ``[..., r]`` and candidates ``cands`` ``[..., k]``."""
        left = self.predecessor_codebook(prev) * gate
        return (self.successor_codebook(cands) * left[..., None, :]).sum(-1).float()

    def select(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchors: torch.Tensor,
        temperature: torch.Tensor | None = None,
        vocab_ids: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Selection:
        """Left-to-right choice over ``hidden`` ``[n, L, H]`` and draft ``logits`` ``[n, L, V']``
        from ``anchors`` ``[n]``. ``temperature`` ``[n]`` (None or 0: greedy rows)."""
        unary, cands = self.candidates(logits, vocab_ids)
        gate = self.hidden_projection(hidden)
        sampled = temperature is not None and bool((temperature > 0).any())
        prev = anchors
        path, qs = [], []
        for j in range(hidden.shape[1]):
            scores = unary[:, j] + self.pair_scores(prev, gate[:, j], cands[:, j])
            pick = scores.argmax(dim=-1)
            if sampled:
                temp = temperature.float().clamp_min(1e-6)[:, None]
                q = torch.softmax(scores / temp, dim=-1)
                drawn = torch.multinomial(q, 1, generator=generator)[:, 0]
                hot = temperature > 0
                pick = torch.where(hot, drawn, pick)
                qs.append(torch.where(hot[:, None], q, F.one_hot(pick, q.shape[-1]).float()))
            prev = cands[:, j].gather(-1, pick[:, None])[:, 0]
            path.append(prev)
        return Selection(torch.stack(path, 1), cands, torch.stack(qs, 1) if sampled else None)


# --------------------------------------------------------------------------- model


class DFlash2DraftModel(DFlashDraftModel):
    def __init__(self, cfg: DFlash2Config, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.layers = nn.ModuleList(
            DFlash2Layer(cfg.layer, cfg.conv_kernel_size, cfg.conv_group_size)
            for _ in range(cfg.num_layers)
        )
        self.candidate_selector = CandidateSelector(cfg)

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[LayerKV],
        block_len: int | None = None,
    ) -> torch.Tensor:
        """Run query blocks of ``block_len`` positions each (non-causal metadata) and return
        the final-normed states; the convolutions stay within each block."""
        if block_len is None:
            raise ValueError("DFlash2 drafts need the query block length")
        h = block_embeds
        rope = self.rotary.lookup(positions, h.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(rope, h, meta, kv, block_len)
        return self.norm(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """DFlash weights plus the convolutions and the selector (either codebook spelling)."""
        params = dict(self.named_parameters())
        extra: set[str] = set()

        def split() -> Iterable[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = hf_name.removeprefix("model.")
                name = CODEBOOK_KEYS.get(name, name)
                if _dflash2_only(name):
                    if name not in params:
                        raise WeightLoadError(f"Draft tensor {hf_name!r} has no matching parameter")
                    with torch.no_grad():
                        _copy(params[name].data, tensor, hf_name)
                    extra.add(name)
                else:
                    yield hf_name, tensor

        super().load_weights(split(), ignore=_dflash2_only)
        missing = [n for n in params if _dflash2_only(n) and n not in extra]
        if missing:
            raise WeightLoadError(f"Draft checkpoint is missing weights: {missing[:8]}")


def _dflash2_only(name: str) -> bool:
    """Parameters a DFlash draft does not have: the block convolutions and the selector."""
    return "_conv." in name or name.startswith("candidate_selector.")
