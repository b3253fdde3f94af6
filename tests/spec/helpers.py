"""Shared builders for the speculative-decoding tests: tiny random targets, random drafts in
the reference checkpoint format, an oracle proposer, and small statistics helpers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine import LLM, SamplingParams

# -- tiny models -----------------------------------------------------------------------------

TARGET_VOCAB = 256
TARGET_LAYERS = 4
TARGET_HIDDEN = 64


def save_target(folder: Path, arch: str = "qwen3", *, vocab: int = TARGET_VOCAB,
                hidden: int = TARGET_HIDDEN, layers: int = TARGET_LAYERS, seed: int = 0,
                init: float = 0.3, max_positions: int = 256, tie: bool = False) -> Path:
    """A random Qwen3 or Llama causal LM saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                  "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
                  "initializer_range": init, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                  "tie_word_embeddings": tie}
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // 4, rope_theta=1e6))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=1e4))
    model.eval().save_pretrained(folder, safe_serialization=True)
    return folder


def draft_hf_config(*, hidden: int = TARGET_HIDDEN, layers: int = 2, heads: int = 4,
                    kv_heads: int = 1, head_dim: int = 32, block_size: int = 4,
                    target_layer_ids: Sequence[int] | None = (1, 2),
                    mask_token_id: int | None = TARGET_VOCAB - 1,
                    num_target_layers: int = TARGET_LAYERS, vocab: int = TARGET_VOCAB,
                    init: float = 0.3, rope_theta: float = 1e6, intermediate: int = 96):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, rms_norm_eps=1e-6,
                      initializer_range=init, rope_theta=rope_theta)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = block_size
    cfg.num_target_layers = num_target_layers
    dflash = {}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    if mask_token_id is not None:
        dflash["mask_token_id"] = mask_token_id
    cfg.dflash_config = dflash
    return cfg


def save_draft(folder: Path, *, seed: int = 1, randomize_norms: bool = False,
               mask_embedding: torch.Tensor | None = None, **cfg_kwargs):
    """A random draft written with the reference implementation's ``save_pretrained``.

    Returns the reference model (float32, eval) so tests can run it side by side.
    """
    from dflash.model import DFlashDraftModel as RefDraft

    torch.manual_seed(seed)
    ref = RefDraft(draft_hf_config(**cfg_kwargs)).float().eval()
    if randomize_norms:
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
    ref.save_pretrained(folder, safe_serialization=True)
    if mask_embedding is not None:
        from safetensors.torch import save_file

        save_file({"mask_embedding": mask_embedding.contiguous()},
                  str(Path(folder) / "mask_embedding.safetensors"))
    return ref


def add_draft_vocab(folder: Path, target_ids: Sequence[int]) -> None:
    """Give a saved draft a reduced vocabulary: ``draft_vocab_size`` and the ``d2t`` offsets."""
    from safetensors.torch import load_file, save_file

    ids = torch.tensor(list(target_ids), dtype=torch.long)
    weights = load_file(str(Path(folder) / "model.safetensors"))
    weights["d2t"] = ids - torch.arange(ids.shape[0])
    save_file(weights, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    edit_json(Path(folder) / "config.json", draft_vocab_size=len(ids))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# -- running ---------------------------------------------------------------------------------

def make_llm(model, spec=None, **kwargs) -> LLM:
    """An engine on a tiny model. A speculative config dict verifies a fixed number of drafts
    (``"adaptive": false``) unless it says otherwise: these tests exercise verification itself,
    which the adaptive controller would (rightly) skip for drafts that rarely hit."""
    args = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 192}
    args.update(kwargs)
    if isinstance(spec, dict):
        spec = {"adaptive": False, **spec}
    return LLM(model=str(model), speculative_config=spec, **args)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def random_prompts(lengths: Sequence[int], vocab: int = TARGET_VOCAB, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_tokens(got: list[list[int]], want: list[list[int]], what: str = "") -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        d = first_divergence(g, w)
        assert d is None, (
            f"{what} request {i}: speculative output diverges from the baseline at output "
            f"index {d}: got {g[max(0, d - 2): d + 3]} want {w[max(0, d - 2): d + 3]} "
            f"(lengths {len(g)} vs {len(w)})"
        )


# -- oracle proposer -------------------------------------------------------------------------

class OracleProposer:
    """Proposes the target's true greedy continuation (precomputed without speculation).

    ``corrupt(call_index, request_id) -> int | None`` may name a draft position to replace by a
    wrong token, which forces acceptance of exactly that many drafts.
    """

    capture_layers: tuple[int, ...] = ()
    lookahead_slots = 0
    draft_seconds = 0.0
    windows: dict[str, list[int]] = {}  # chains (or a tree in its fixed order) only

    def __init__(self, futures: dict[tuple[int, ...], list[int]], k: int, vocab: int,
                 corrupt: Callable[[int, str], int | None] | None = None) -> None:
        self.futures = futures
        self.num_speculative_tokens = k
        self.vocab = vocab
        self.corrupt = corrupt
        self.calls = 0
        self.proposed: list[tuple[str, int, list[int]]] = []  # (request, outputs so far, drafts)

    def layer_specs(self) -> list:
        return []

    def bind(self, pool, backend) -> None:
        return None

    def propose(self, items, captured) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for it in items:
            if not it.sampled or not it.num_drafts:
                continue
            req = it.item.request
            done = len(req.output_token_ids) + len(it.sampled)
            drafts = list(self.futures[tuple(req.prompt_token_ids)][done: done + self.num_speculative_tokens])
            if self.corrupt is not None and drafts:
                j = self.corrupt(self.calls, req.request_id)
                if j is not None and j < len(drafts):
                    drafts[j] = (drafts[j] + 1) % self.vocab
            self.calls += 1
            self.proposed.append((req.request_id, done, list(drafts)))
            if drafts:
                out[req.request_id] = drafts
        return out


def expected_full_acceptance(max_tokens: int, k: int) -> tuple[int, int, list[int]]:
    """(drafts, accepted, per-position counts) when every draft is right and the scheduler trims
    drafts to ``max_tokens - outputs - 1``; drafts trimmed to nothing are plain decodes."""
    outputs, drafts, accepted, per_pos = 1, 0, 0, [0] * k
    while outputs < max_tokens:
        s = min(k, max_tokens - outputs - 1)
        if s > 0:
            drafts += 1
            accepted += s
            for j in range(s):
                per_pos[j] += 1
        outputs += s + 1
    return drafts, accepted, per_pos


# -- statistics -------------------------------------------------------------------------------

def chi_square_pvalue(counts: dict, probs: dict, n: int, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson goodness of fit of ``counts`` against ``probs``; bins with small expectation are
    pooled. Returns (statistic, p-value, degrees of freedom)."""
    keys = sorted(set(probs) | set(counts), key=lambda k: -probs.get(k, 0.0))
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for key in keys:
        e = probs.get(key, 0.0) * n
        if e >= min_expected:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            pool_o += counts.get(key, 0)
            pool_e += e
    if pool_e > 0 or pool_o > 0:
        if pool_e == 0.0:
            return math.inf, 0.0, max(1, len(obs))  # observed something impossible
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = max(1, len(obs) - 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p, dof
