"""One decoder for the Llama family: Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

The forward pass is a pure function of ``(input_ids, positions, attention metadata, per-layer
KV handles)``; it knows nothing about requests, sampling or serving.

Inside a layer, submodules are run with ``.forward(...)``: ``nn.Module.__call__``'s hook
machinery, eight calls a layer, cost 6% of a one-row SmolLM2-135M target pass on a 2-vCPU AVX2
EPYC (12.37 -> 11.71 ms with direct calls, 0.94x at one and two rows, median of 30 alternating
rounds); nothing here registers hooks (a wrapper put on a module's ``forward`` attribute still
runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attention.backends.base import AttentionMetadata
from attention.kv import LayerKV, SlotIndex, write_kv
from models.layers import (Linear, Packed, PackedWeight, RMSNorm, Rope, RotaryEmbedding, SwiGLU,
                           apply_rotary, cpu_ops, fastest_min_rows, linear, pack_weight)


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model built from its config."""


@dataclass(frozen=True)
class StackShape:
    """What every Llama-family layer stack shares, target or draft: sizes, heads, norm epsilon
    and RoPE (the fields ``models.loader.layer_fields`` parses)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None

    def layer_spec(self, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> LayerSpec:
        return LayerSpec(self.hidden_size, self.intermediate_size, self.num_heads,
                         self.num_kv_heads, self.head_dim, self.rms_norm_eps,
                         qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)


@dataclass(frozen=True)
class DecoderConfig(StackShape):
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @property
    def layer(self) -> LayerSpec:
        return self.layer_spec(qkv_bias=self.attention_bias, o_bias=False, qk_norm=self.qk_norm)


@dataclass(frozen=True)
class LayerSpec:
    """One pre-norm decoder layer, as the target and the DFlash drafts build it: Llama (no
    q/k norm), Qwen2 (q/k/v bias) and Qwen3 / DFlash (q/k RMSNorm; the drafts' ``o_proj``
    carries a bias when ``attention_bias`` is set)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# Hugging Face parameter name -> (our fused parameter, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5
        self.kv_packed: Packed | None = None  # see pack_kv

    def qkv(self, rope: Rope, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[N, Hq, D]``, K and V ``[N, Hkv, D]`` of ``x`` (q/k norm and RoPE applied).

        On the CPU, Q and K (adjacent heads of the projection) get their q/k norms, if any,
        and RoPE in one compiled pass (the same operations on the same values as the PyTorch
        ops below: the same bits), Q and K contiguous; V is a view."""
        n = x.shape[0]
        heads = self.qkv_proj.forward(x).view(n, -1, self.head_dim)
        nq, nk = self.num_heads, self.num_kv_heads
        if self.q_norm is None:
            ops = cpu_ops(heads, *rope)
            if ops is not None:  # the same ops in one pass, Q and K contiguous
                q, k = ops.rope_qk(heads, *rope, nq, nk)
                return q, k, heads[:, nq + nk :]
            qk = apply_rotary(heads[:, : nq + nk], *rope)
            return qk[:, :nq], qk[:, nq:], heads[:, nq + nk :]
        qw, kw = self.q_norm.weight, self.k_norm.weight
        ops = cpu_ops(heads, *rope, qw, kw)
        if ops is not None:  # norms and RoPE in one pass (the same bits as the ops below)
            q, k = ops.rope_qk(heads, *rope, nq, nk, qw, kw, self.q_norm.eps)
            return q, k, heads[:, nq + nk :]
        q, k, v = heads.split([nq, nk, nk], dim=1)
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def pack_kv(self, products: str = "onednn") -> None:
        """Keep a packed copy of the K/V rows of the projection for :meth:`kv` (before the
        projection itself is packed and its plain weight dropped)."""
        self.kv_packed = pack_weight(self.qkv_proj.weight[self.q_size :].contiguous(), products)

    def kv(self, rope: Rope, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V alone (the DFlash drafts' context K/V of fused target features)."""
        n = x.shape[0]
        proj = self.qkv_proj
        b = None if proj.bias is None else proj.bias[self.q_size :]
        if self.kv_packed is not None:
            kv = linear(x, None, b, packed=self.kv_packed, min_rows=proj.min_rows)
        else:
            kv = linear(x, proj.weight[self.q_size :], b)
        nk, norm = self.num_kv_heads, self.k_norm
        heads = kv.view(n, 2 * nk, self.head_dim)
        kw = None if norm is None else norm.weight
        ops = cpu_ops(heads, *rope) if kw is None else cpu_ops(heads, *rope, kw)
        if ops is not None:  # (the k norm and) RoPE in one pass, as in qkv
            _, k = ops.rope_qk(heads, *rope, 0, nk, None, kw, 0.0 if norm is None else norm.eps)
            return k, heads[:, nk:]
        k = heads[:, :nk] if norm is None else norm(heads[:, :nk])
        return apply_rotary(k, *rope), heads[:, nk:]

    def forward(
        self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> torch.Tensor:
        q, k, v = self.qkv(rope, x)
        out = meta.attend(q, k, v, kv, self.scale)
        return self.o_proj.forward(out.reshape(x.shape[0], self.q_size))

    def forward_rows(
        self, rope: Rope, x: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata,
        slots: SlotIndex, kv: LayerKV,
    ) -> torch.Tensor:
        """:meth:`forward` for the rows ``rows`` of ``x`` alone: every row's K/V is written (at
        ``slots``), since the kept rows attend to all of them, and only the kept rows' queries
        attend (``meta`` describes those rows) and are projected out."""
        q, k, v = self.qkv(rope, x)
        write_kv(kv, k, v, slots)
        # (``attend`` writes the kept rows' K/V once more: the same values to the same slots)
        out = meta.attend(q.index_select(0, rows), k.index_select(0, rows),
                          v.index_select(0, rows), kv, self.scale)
        return self.o_proj.forward(out.reshape(rows.shape[0], self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, rope: Rope, h: torch.Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> torch.Tensor:
        attn = self.self_attn.forward(rope, self.input_layernorm.forward(h), meta, kv)
        x, h = self.post_attention_layernorm.add(attn, h)
        return h + self.mlp.forward(x)

    def forward_rows(
        self, rope: Rope, h: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata,
        slots: SlotIndex, kv: LayerKV,
    ) -> torch.Tensor:
        """The outputs of the rows ``rows`` of ``h`` alone (``Attention.forward_rows``); every
        operation is row-wise or row-count invariant, so each is the same as :meth:`forward`'s."""
        attn = self.self_attn.forward_rows(rope, self.input_layernorm.forward(h), rows, meta,
                                           slots, kv)
        x, h = self.post_attention_layernorm.add(attn, h.index_select(0, rows))
        return h + self.mlp.forward(x)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder with a tied or untied LM head."""

    def __init__(self, cfg: DecoderConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    head_packed: Packed | None = None
    min_rows: int = 2  # padding of small products (``layers.linear``), chosen by pack_weights
    products: str = "onednn"  # how the bf16 weights were packed (``layers.pack_weight``)

    def pack_weights(self, head: bool = True, products: str = "onednn") -> None:
        """Pack the decoder layers' projections (dropping their plain weights) and, with
        ``head``, a copy of the LM head (whose plain weight the embedding and the drafts' heads
        still read) for the CPU's GEMM (``layers.pack_weight``; nothing changes on other
        devices; ``products``: see ``layers.pack_weight``). The last step of loading: the model
        must not be moved or cast afterwards."""
        self.products = products
        modules = [m for m in self.layers.modules() if isinstance(m, PackedWeight)]
        for module in modules:
            module.pack(products)
        if head:
            self.head_packed = pack_weight(self.lm_head_weight, products)
        # the padding of 1-row products (same bits whatever it is): the fastest, timed here
        products = [m.packed for m in modules if m.packed is not None]
        if self.head_packed is not None:
            products.append(self.head_packed)
        self.min_rows = fastest_min_rows(products)
        for module in modules:
            module.min_rows = self.min_rows

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}" for i in range(self.config.num_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[LayerKV],
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the final-normed hidden states ``[N, H]`` and, if ``capture`` names layer
        ids, the outputs of those decoder layers concatenated in that order ``[N, len*H]``."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, h.dtype)
        wanted = {layer_id: None for layer_id in capture}
        for i, layer in enumerate(self.layers):
            h = layer.forward(rope, h, meta, kv_caches[i])
            if i in wanted:
                wanted[i] = h
        captured = torch.cat([wanted[i] for i in capture], dim=-1) if capture else None
        return self.norm(h), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores ``[N, V]`` in the model's dtype (the sampler widens the rows it does more
        than an argmax with: a verification step's 32 rows are 6 MB of float32)."""
        return linear(hidden, self.lm_head_weight, packed=self.head_packed,
                      min_rows=self.min_rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in PACKED:
                fused, shard = PACKED[parts[-2]]
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                raise WeightLoadError(f"Checkpoint tensor {hf_name!r} has no matching parameter")
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    _copy(param.data, tensor, hf_name)
                else:
                    start, size = _shard_range(self.config, parts[-2], shard)
                    _copy(param.data[start : start + size], tensor, hf_name)
            loaded.add(f"{name}#{shard}")
        missing = [
            n for n in params
            if sum(key.startswith(n + "#") for key in loaded) < _num_shards(n)
        ]
        if missing:
            raise WeightLoadError(f"Checkpoint is missing weights: {missing[:8]}")


def _num_shards(param_name: str) -> int:
    if ".qkv_proj." in param_name:
        return 3
    return 2 if ".gate_up_proj." in param_name else 1


def _shard_range(cfg: DecoderConfig, hf_proj: str, shard: int) -> tuple[int, int]:
    if hf_proj in ("q_proj", "k_proj", "v_proj"):
        spec = cfg.layer
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    return sum(sizes[:shard]), sizes[shard]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightLoadError(
            f"Checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)
