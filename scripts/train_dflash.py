"""Train a DFlash or DFlash2 draft for a target from stored target features (see
``dflash_data.py``).

Per sequence: random anchors in the response; each anchor's block ``[token, MASK x (B-1)]``
sees only context strictly before its anchor plus its own block (non-causal); slot k predicts
token ``anchor + k`` with cross-entropy weighted by ``exp(-(k-1)/gamma)``. The target's
embedding and LM head are frozen; AdamW with warmup and cosine decay, gradient clipping,
checkpoints every ``--save-every`` steps, ``--resume`` to continue a run. ``--distill W``
mixes in the target's whole next-token distribution (``Teacher``); ``--eval-only`` also walks
each validation sequence as a server would (``served_walk``). ``--refine N`` trains N more
block passes that see the previous pass's guesses (``--refine-threshold``: only the sure ones),
served as trained; ``--vocab-from`` keeps a saved draft's reduced vocabulary. ``--ema D``
keeps an exponential moving average of the weights (``WeightAverage``): validation, and so
``out/draft``, score the average; the last trained weights go to ``out/draft-raw``.

``--dflash2`` trains a DFlash2 draft (``models/dflash2.py``): the same blocks and loss, with
block convolutions in every layer (initialised to the identity, so training starts from a
DFlash draft) and the candidate selector, trained by teacher forcing on the cross-entropy of
the true token among the top-k candidates (``selector_terms``; weight ``--selector-weight``).
Its validation acceptance is the selector's greedy path, as served.

    python scripts/train_dflash.py --data DIR --out DIR --layers 1 --taps 1 14 27 --block-size 8
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.dflash import D2T_KEY, DFlashDraftModel, refinement_inputs  # noqa: E402
from models.dflash2 import DFlash2DraftModel, DFlash2Layer, draft_config  # noqa: E402
from models.dflash2 import build_draft as build_draft_model  # noqa: E402
from models.dflash_init import draft_hf_config, save_draft  # noqa: E402

# --------------------------------------------------------------------------- masks and labels


def block_mask(seq_len: int, anchors: list[int], block_size: int) -> torch.Tensor:
    """``[N*B, S + N*B]`` bool: block n's queries see context ``j < anchors[n]`` and the whole of
    block n (its own positions, both directions); blocks never see each other."""
    n = len(anchors)
    q_block = torch.arange(n * block_size) // block_size  # [NB]
    ctx = torch.arange(seq_len)[None, :] < torch.tensor(anchors)[q_block][:, None]
    blk = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx, blk], dim=1)


def block_labels(ids: torch.Tensor, anchors: list[int], block_size: int) -> torch.Tensor:
    """``[N, B]`` labels: slot k of anchor a is ``ids[a + k]``; slot 0 and past-the-end: -100."""
    s = ids.shape[0]
    labels = torch.full((len(anchors), block_size), -100, dtype=torch.long)
    for i, a in enumerate(anchors):
        for k in range(1, block_size):
            if a + k < s:
                labels[i, k] = int(ids[a + k])
    return labels


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for k >= 1; slot 0 has weight 0."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(prompt_len: int, seq_len: int, count: int, rng: random.Random) -> list[int]:
    """Distinct random anchors in the response (each leaves at least one label)."""
    lo, hi = max(1, prompt_len - 1), seq_len - 2
    if hi < lo:
        return []
    pool = list(range(lo, hi + 1))
    return sorted(rng.sample(pool, min(count, len(pool))))


# --------------------------------------------------------------------------- dense forward


def dense_forward(
    draft: DFlashDraftModel,
    target_feats: torch.Tensor,
    block_embeds: torch.Tensor,
    block_pos: torch.Tensor,
    mask: torch.Tensor,
    block_len: int | None = None,
) -> torch.Tensor:
    """Training forward without a paged cache: context ``[S, taps*H]`` at positions ``0..S-1``,
    blocks ``[N*B, H]`` at ``block_pos``; returns final-normed block states ``[N*B, H]``.
    ``block_len`` (B) is needed by DFlash2 drafts, whose convolutions run within each block."""
    cfg = draft.config
    s = target_feats.shape[0]
    ctx = draft.fuse(target_feats)
    ctx_rope = draft.rotary.lookup(torch.arange(s), ctx.dtype)
    blk_rope = draft.rotary.lookup(block_pos, ctx.dtype)
    h = block_embeds
    for layer in draft.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = attn.kv(ctx_rope, ctx)

        def attend(x: torch.Tensor) -> torch.Tensor:
            q, k, v = attn.qkv(blk_rope, x)
            keys = torch.cat([k_ctx, k]).transpose(0, 1)  # [Hkv, S+M, D]
            vals = torch.cat([v_ctx, v]).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], vals[None], attn_mask=mask[None, None],
                scale=attn.scale, enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )[0]
            return attn.o_proj(out.transpose(0, 1).reshape(x.shape[0], attn.q_size))

        if isinstance(layer, DFlash2Layer):  # block convolutions around both sublayers
            h = h + layer.attention_conv.around(attend, layer.input_layernorm(h), block_len)
            h = h + layer.mlp_conv.around(layer.mlp, layer.post_attention_layernorm(h), block_len)
        else:
            h = h + attend(layer.input_layernorm(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)


# --------------------------------------------------------------------------- data


@dataclass
class Sequence:
    ids: torch.Tensor  # [S] int
    feats: torch.Tensor  # [S, taps*H] float16, or every stored layer's with ``cols``
    prompt_len: int
    cols: torch.Tensor | None = None  # the taps' columns of ``feats`` when it holds more

    def features(self) -> torch.Tensor:
        """The tapped features [S, taps*H] as float32."""
        feats = self.feats if self.cols is None else self.feats.index_select(1, self.cols)
        return feats.float()


def tap_columns(stored: list[int], taps: list[int], width: int) -> torch.Tensor:
    """Columns of ``taps``, in that order, in a concatenation of the ``stored`` layers' states
    (``width`` columns each): stored features, and the saved ``fc`` of a draft with more taps."""
    return torch.cat([torch.arange(stored.index(t) * width, (stored.index(t) + 1) * width)
                      for t in taps])


def load_sequences(data: Path, taps: list[int]) -> list[Sequence]:
    meta = json.loads((data / "features.json").read_text())
    stored = meta["layers"]
    missing = [t for t in taps if t not in stored]
    if missing:
        raise ValueError(f"Taps {missing} were not stored; stored layers: {stored}")
    seqs = []
    for name in meta["shards"]:
        # memory-mapped: the features stay in the page cache, not in this process (millions of
        # tokens of several layers do not fit in memory); each sequence's taps are cut out when
        # it is used
        shard = torch.load(data / name, mmap=True)
        feats = shard["features"]
        hidden = feats.shape[1] // len(stored)
        cols = None if taps == stored else tap_columns(stored, taps, hidden)
        start = 0
        for n, p in zip(shard["lengths"].tolist(), shard["prompt_lengths"].tolist()):
            seqs.append(Sequence(shard["ids"][start : start + n].long(), feats[start : start + n],
                                 p, cols))
            start += n
    return seqs


# --------------------------------------------------------------------------- training


@dataclass
class Frozen:
    embed: torch.Tensor  # [V, H]
    head: torch.Tensor  # [V or N, H]: bfloat16 values (as served), in the dtype products run in
    vocab_ids: torch.Tensor | None = None  # [N] target ids of a reduced draft vocabulary
    t2d: torch.Tensor | None = None  # [V] draft index of each target id, -1 if absent

    def restrict(self, vocab_ids: torch.Tensor) -> Frozen:
        """The same frozen weights with the head cut to a reduced draft vocabulary."""
        t2d = torch.full((self.embed.shape[0],), -1, dtype=torch.long)
        t2d[vocab_ids] = torch.arange(vocab_ids.shape[0])
        return Frozen(self.embed, self.head.index_select(0, vocab_ids).contiguous(), vocab_ids, t2d)

    def with_head_dtype(self, dtype: torch.dtype) -> Frozen:
        """The same weights with the head's products run in ``dtype`` (its values are
        bfloat16's, so float32 holds them exactly)."""
        return Frozen(self.embed, self.head.to(dtype), self.vocab_ids, self.t2d)


def fastest_head_dtype(head: torch.Tensor, rows: int, rounds: int = 3
                       ) -> tuple[torch.dtype, dict[str, float]]:
    """The faster of bfloat16 and float32 for a training step's head: the product of ``rows``
    draft states with ``head`` and the gradient back to the states, as autograd runs them,
    timed in alternating rounds (best of ``rounds``; seconds per dtype returned too).

    Measured, not guessed: bfloat16 halved the head's cost on CPUs with AVX-512 BF16 or AMX,
    while on an AVX2-only EPYC PyTorch's bfloat16 product took 216 ms and the gradient
    (``grad @ head``) 2.7 s where float32 took 37 and 28 ms."""
    states = torch.randn(rows, head.shape[1], requires_grad=True)
    candidates = {name: head.to(getattr(torch, name)) for name in ("bfloat16", "float32")}

    def once(weight: torch.Tensor) -> float:
        start = time.perf_counter()
        (states.to(weight.dtype) @ weight.t()).float().sum().backward()
        return time.perf_counter() - start

    best = {name: math.inf for name in candidates}
    for name, weight in candidates.items():
        once(weight)  # first calls pick and warm their kernels
    for _ in range(rounds):
        for name, weight in candidates.items():
            best[name] = min(best[name], once(weight))
    return getattr(torch, min(best, key=best.get)), best


def build_draft_vocab(seqs: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` target ids the draft will score: every response token by frequency, then
    the lowest unused ids (BPE ids roughly follow merge order, i.e. corpus frequency)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in seqs:
        counts += torch.bincount(seq.ids[seq.prompt_len :], minlength=vocab_size)
    # stable: equal counts (the unseen ids among them) keep ascending id order
    by_freq = torch.argsort(-counts, stable=True)
    return torch.sort(by_freq[:size]).values


def saved_draft_vocab(folder: Path) -> torch.Tensor:
    """The target ids a saved draft scores (its ``d2t``), e.g. to keep a shipped draft's
    vocabulary when continuing it on a piece of data too small to derive a good one."""
    from models.dflash import iter_draft_weights

    d2t = dict(iter_draft_weights(folder)).get(D2T_KEY)
    if d2t is None:
        raise ValueError(f"--vocab-from {folder}: the draft has no reduced vocabulary (d2t)")
    return torch.arange(d2t.shape[0]) + d2t.long()


def selector_terms(
    draft: DFlash2DraftModel, frozen: Frozen, h: torch.Tensor, logits: torch.Tensor,
    prev: torch.Tensor, labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidate selector under teacher forcing, for M block positions: states ``h``
    ``[M, H]``, draft logits ``[M, V']``, the true previous tokens ``prev`` and labels ``[M]``
    (target ids). Returns the per-position cross-entropy of the label among the candidates
    (``[M]``, 0 where the label is not a candidate), whether it is one, and the selector's
    greedy pick (target ids).

    Why this objective: at serving time position j's draft only counts while drafts 1..j-1
    were accepted, i.e. equal to the target's tokens; then the selector's predecessor is the
    true previous token. So training with the true predecessor (teacher forcing) scores
    exactly the situations that decide acceptance. Among the top-k candidates the selector
    picks ``argmax score`` (greedy) or samples ``softmax(score / T)``; maximising the
    likelihood of the label under ``softmax(score)`` raises both the greedy hit rate and, at
    T = 1, the proposal probability q of the label (which is what rejection sampling accepts
    on). A label outside the candidates gets no selector loss: only the draft's own
    cross-entropy can bring it into the top-k. The candidates are chosen without gradient
    (top-k); the loss reaches the unary logits, the codebooks, the projection and the states.
    """
    sel = draft.candidate_selector
    unary, idx = logits.topk(sel.top_k, dim=-1)
    cands = idx if frozen.vocab_ids is None else frozen.vocab_ids[idx]
    scores = unary + sel.pair_scores(prev, sel.hidden_projection(h), cands)
    match = cands == labels[:, None]
    present = match.any(-1)
    ce = F.cross_entropy(scores, match.float().argmax(-1), reduction="none") * present
    pick = cands.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
    return ce, present, pick


def block_inputs(draft: DFlashDraftModel, frozen: Frozen, seq: Sequence, anchors: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the first block pass at ``anchors`` sees, as served: the context features, the block
    embeddings ``[N, B, H]`` (the anchor's token, then MASK), their positions ``[N*B]``, the
    attention mask, and the labels of the drafted slots ``[N, B-1]`` (-100 past the end)."""
    b = draft.config.block_size
    emb = draft.mask_embedding.expand(len(anchors), b, -1).clone()
    emb[:, 0] = frozen.embed[seq.ids[torch.tensor(anchors)]]
    pos = (torch.tensor(anchors)[:, None] + torch.arange(b)[None, :]).reshape(-1)
    mask = block_mask(seq.ids.shape[0], anchors, b)
    return seq.features(), emb, pos, mask, block_labels(seq.ids, anchors, b)[:, 1:]


@torch.no_grad()
def slot_ranks(draft: DFlashDraftModel, frozen: Frozen, seq: Sequence, chunk: int = 64,
               width: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[A, B-1]``: for a block anchored at every response position but the last, the rank of
    the target's token among the draft's scores at each slot (0: the draft's greedy choice),
    from one block pass of a DFlash draft. A token past the end or outside the draft vocabulary
    ranks ``frozen.head.shape[0]`` (never proposed). The input of tree simulations. With
    ``width``, also ``[A, B-1, width]``: each slot's ``width`` largest probabilities (the
    draft's softmax over its vocabulary), best first: its confidence in its candidates."""
    b = draft.config.block_size
    anchors = list(range(seq.prompt_len, seq.ids.shape[0] - 1))
    never = frozen.head.shape[0]
    out, probs = [], []
    for i in range(0, len(anchors), chunk):
        part = anchors[i : i + chunk]
        feats, emb, pos, mask, lab = block_inputs(draft, frozen, seq, part)
        h = dense_forward(draft, feats, emb.reshape(-1, emb.shape[-1]), pos, mask, block_len=b)
        scores = (h.view(len(part), b, -1)[:, 1:].to(frozen.head.dtype) @ frozen.head.t()).float()
        target = lab.clamp_min(0)
        if frozen.vocab_ids is not None:
            target = frozen.t2d[target]
        known = (lab != -100) & (target >= 0)
        mine = scores.gather(-1, target.clamp_min(0)[..., None])
        ranks = (scores > mine).sum(-1)
        out.append(torch.where(known, ranks, torch.full_like(ranks, never)))
        if width:
            probs.append(scores.softmax(-1).topk(width, dim=-1).values)
    return (torch.cat(out), torch.cat(probs)) if width else torch.cat(out)


def sequence_loss(
    draft: DFlashDraftModel, frozen: Frozen, seq: Sequence, anchors: list[int], gamma: float,
    selector_weight: float = 1.0, teacher: Teacher | None = None, distill: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted CE over the blocks of one sequence; also per-slot correct and valid counts, and
    per-block hit flags ``[N, B-1]`` (prediction equals a valid label) for acceptance.

    With a ``teacher`` and ``distill`` = w > 0 each slot's term is ``(1 - w)`` times the CE of
    the target's token plus ``w`` times the CE of the target's whole distribution there
    (restricted to the draft vocabulary), with the same position weights.

    DFlash2 drafts add ``selector_weight`` times the selector's weighted cross-entropy (see
    ``selector_terms``), and their predictions are the selector's greedy picks, as served."""
    b = draft.config.block_size
    feats, emb, pos, mask, lab = block_inputs(draft, frozen, seq, anchors)
    valid = lab != -100
    # the position before each valid slot: slot k of anchor a predicts token a + k from a+k-1
    before = (torch.tensor(anchors)[:, None] + torch.arange(b - 1)[None, :])[valid]
    target = lab[valid]
    w = position_weights(b, gamma)[1:].expand_as(lab)[valid]
    if frozen.vocab_ids is not None:
        # a label outside the draft vocabulary cannot be predicted: no loss, counted a miss
        target = frozen.t2d[target]
        w = w * (target >= 0)
        target = target.clamp_min(0)
    soft = None
    if teacher is not None and distill > 0:
        soft = teacher.logits(feats, before, frozen.head).softmax(-1)  # the draft's vocabulary
    # Pass 0 sees MASK at every drafted slot; each refinement pass sees the previous pass's
    # greedy guesses there instead (as served, see DFlashConfig.refine_passes). Every pass is
    # trained on the labels, so the guesses a refinement starts from stay good; the served
    # proposals (and the hits below) are the last pass's.
    passes = 1 + draft.config.refine_passes
    masks = emb[:, 1:]
    loss = torch.zeros(())
    for i in range(passes):
        h = dense_forward(draft, feats, emb.reshape(-1, emb.shape[-1]), pos, mask, block_len=b)
        h = h.view(len(anchors), b, -1)[:, 1:]
        # the frozen head dominates the cost; its dtype is measured (see fastest_head_dtype)
        scores = (h.to(frozen.head.dtype) @ frozen.head.t()).float()  # every slot: the guesses
        logits = scores[valid]
        ce = F.cross_entropy(logits, target, reduction="none")
        if soft is not None:
            ce = (1 - distill) * ce + distill * F.cross_entropy(logits, soft, reduction="none")
        loss = loss + (w * ce).sum() / w.sum().clamp_min(1e-6) / passes
        if i + 1 < passes:
            emb = emb.clone()
            emb[:, 1:] = refinement_inputs(scores.detach(), masks, frozen.vocab_ids,
                                           lambda ids: frozen.embed[ids],
                                           draft.config.refine_threshold)
    correct = torch.zeros(b - 1)
    counts = torch.zeros(b - 1)
    slot = torch.arange(1, b).expand_as(lab)[valid] - 1
    counts.index_add_(0, slot, torch.ones_like(ce))
    best = logits.argmax(-1)
    if frozen.vocab_ids is not None:
        best = frozen.vocab_ids[best]
    if isinstance(draft, DFlash2DraftModel):
        # the true token before each slot: the anchor for slot 1, else the previous label
        sel_ce, present, best = selector_terms(draft, frozen, h[valid], logits, seq.ids[before],
                                               lab[valid])
        sel_w = w * present
        loss = loss + selector_weight * (sel_w * sel_ce).sum() / sel_w.sum().clamp_min(1e-6)
    right = best == lab[valid]
    correct.index_add_(0, slot, right.float())
    hits = torch.zeros(lab.shape, dtype=torch.long)
    hits[valid] = right.long()
    return loss, correct, counts, hits


def lr_at(step: int, total: int, peak: float, warmup_frac: float) -> float:
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def simulated_acceptance(correct_prefix: torch.Tensor) -> float:
    """Mean accepted length (bonus included) from per-block prefix-correct flags [N, B-1]."""
    return float((correct_prefix.cumprod(dim=1).sum(dim=1) + 1).float().mean())


@torch.no_grad()
def accepted_prefixes(draft, frozen: Frozen, seq: Sequence, chunk: int = 64) -> list[int]:
    """For every response position but the last, how many drafted tokens the target accepts
    from a block anchored there (its correct prefix), the anchors run ``chunk`` at a time."""
    anchors = list(range(seq.prompt_len, seq.ids.shape[0] - 1))
    prefix = []
    for i in range(0, len(anchors), chunk):
        hits = sequence_loss(draft, frozen, seq, anchors[i : i + chunk], 1.0)[3]
        prefix += hits.cumprod(dim=1).sum(dim=1).int().tolist()
    return prefix


def served_walk(draft, frozen: Frozen, seq: Sequence, chunk: int = 64) -> tuple[int, int]:
    """Tokens gained and steps taken by greedy speculation at the full block over one stored
    sequence, as a server would run it: the first block's anchor is the first response token
    (the prefill's), each step gains its draft's correct prefix plus the target's own token,
    and that last token anchors the next block. Unlike the random anchors of
    ``simulated_acceptance``, steps linger where drafting fails, so ``tokens / steps`` is the
    served mean acceptance length (the ``vllm:spec_decode`` counters' figure)."""
    s, first = seq.ids.shape[0], seq.prompt_len
    accepted = accepted_prefixes(draft, frozen, seq, chunk)  # every position it could stop at
    a, tokens, steps = first, 0, 0
    while a < s - 1:
        gained = accepted[a - first] + 1
        tokens, steps, a = tokens + gained, steps + 1, a + gained
    return tokens, steps


@torch.no_grad()
def evaluate(draft, frozen, seqs, anchors_per_seq, gamma, seed=1234) -> dict:
    rng = random.Random(seed)
    b = draft.config.block_size
    acc_lens, losses = [], []
    correct = torch.zeros(b - 1)
    counts = torch.zeros(b - 1)
    for seq in seqs:
        anchors = sample_anchors(seq.prompt_len, seq.ids.shape[0], anchors_per_seq, rng)
        anchors = [a for a in anchors if a + b - 1 < seq.ids.shape[0]]
        if not anchors:
            continue
        loss, c, n, hits = sequence_loss(draft, frozen, seq, anchors, gamma)
        losses.append(float(loss))
        correct += c
        counts += n
        acc_lens.append(simulated_acceptance(hits))
    return {
        "loss": sum(losses) / max(1, len(losses)),
        "acc_per_pos": (correct / counts.clamp_min(1)).tolist(),
        "sim_accept_len": sum(acc_lens) / max(1, len(acc_lens)),
    }


def build_draft(args, target_cfg, frozen: Frozen) -> tuple[DFlashDraftModel, dict]:
    vocab = frozen.vocab_ids
    dflash2 = None
    if args.dflash2:
        dflash2 = {"conv_kernel_size": args.conv_kernel_size, "conv_group_size": args.conv_group_size,
                   "selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k}
    hf = draft_hf_config(target_cfg, num_layers=args.layers, block_size=args.block_size,
                         target_layer_ids=args.taps, mask_token_id=None,
                         intermediate_size=args.ffn,
                         draft_vocab_size=None if vocab is None else int(vocab.shape[0]),
                         dflash2=dflash2, refine_passes=args.refine,
                         refine_threshold=args.refine_threshold)
    draft = build_draft_model(draft_config(hf), max_positions=args.max_positions)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("conv.base_kernel"):
                # identity (offset 0 weight 1) and zero dynamic kernels: a DFlash2 draft starts
                # as the DFlash draft and learns how much to mix neighbouring block positions
                p.zero_()
                p[:, 0] = 1.0
            elif name.endswith("conv.kernel_projection.weight"):
                p.zero_()
            else:
                torch.nn.init.normal_(p, std=0.02)
    draft.mask_embedding = torch.nn.Parameter(frozen.embed.mean(0).clone())
    if vocab is not None:
        draft.set_d2t(vocab - torch.arange(vocab.shape[0]))
    return draft, hf


def init_from(draft: DFlashDraftModel, hf: dict, folder: Path) -> None:
    """Start from a saved draft's weights (continued training on new data). Its shape must equal
    this run's, with three exceptions, each of which starts the new draft as close to the saved
    one as the change allows:

    - more layers: the saved layers are loaded and each extra one starts as a copy of the last
      with its output projections (attention ``o_proj``, MLP ``down_proj``) zeroed, so the
      deeper draft begins as exactly the saved one (the extra layers add nothing to the
      residual stream) and learns what the extra depth buys;
    - another block size: no weight depends on it (positions are rotary), so all load as saved;
    - other taps: ``fc`` keeps the columns of the saved taps this run uses, and a tap the saved
      draft did not have starts with zero columns (it adds nothing until it is learned).

    Its vocabulary mapping is not taken: the run's own, derived from its training data, stays,
    since the draft's weights do not depend on which rows of the frozen head it scores."""
    from models.dflash import iter_draft_weights
    from models.hf_folder import load_hf_config

    saved = load_hf_config(folder)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim"):
        if saved.get(key) != hf.get(key):
            raise ValueError(f"--init {folder}: {key} is {saved.get(key)}, this run has {hf.get(key)}")
    have, want = saved.get("num_hidden_layers"), hf.get("num_hidden_layers")
    if not isinstance(have, int) or not 1 <= have <= want:
        raise ValueError(f"--init {folder}: {have} layers; this run has {want} (it may add "
                         "layers, not drop them)")
    taps = (saved.get("dflash_config") or {}).get("target_layer_ids") or []
    want_taps = hf["dflash_config"]["target_layer_ids"]
    if not set(want_taps) & set(taps):
        raise ValueError(f"--init {folder}: taps {taps}, this run has {want_taps} (it must keep "
                         "at least one saved tap)")
    width = hf["hidden_size"]
    if saved.get("architectures") != hf.get("architectures"):
        raise ValueError(f"--init {folder}: a {saved.get('architectures')} draft, this run trains "
                         f"{hf.get('architectures')}")

    def weights():
        last = f"layers.{have - 1}."
        for name, t in iter_draft_weights(folder):
            key = name.removeprefix("model.")
            if key in (D2T_KEY, "t2d"):
                continue
            if key == "fc.weight":
                t = torch.cat([t[:, taps.index(w) * width:(taps.index(w) + 1) * width]
                               if w in taps else t.new_zeros(t.shape[0], width)
                               for w in want_taps], dim=1)
            yield name, t
            if key.startswith(last):
                zero = key.endswith(("o_proj.weight", "down_proj.weight"))
                for i in range(have, want):
                    yield f"layers.{i}." + key[len(last):], torch.zeros_like(t) if zero else t

    draft.load_weights(weights())
    draft.mask_embedding.requires_grad_(True)  # loading freezes it (served drafts); train it


def load_frozen(model: str) -> tuple[Frozen, object]:
    from models.hf_folder import iter_safetensors, load_hf_config
    from models.loader import decoder_config
    from models.resolve import resolve_model_path

    path = resolve_model_path(model)
    cfg = decoder_config(load_hf_config(path))
    tensors = dict(iter_safetensors(path))
    embed = tensors["model.embed_tokens.weight"].float()
    head = tensors.get("lm_head.weight", embed).to(torch.bfloat16)  # served in bf16 too
    return Frozen(embed=embed, head=head), cfg


class Teacher:
    """The target's own next-token distribution, recomputed from a stored layer's output.

    The stored features hold the output of the deepest tapped layer; running the target's
    remaining layers (dense causal attention, no cache), its final norm and its head on them
    gives the target's logits at every position of the sequence, without rerunning the layers
    below. Used for distillation (``--distill``): the draft learns the target's whole
    distribution, not only its greedy token. For SmolLM2-135M from layer 27 that is 2 of 30
    layers per training sequence."""

    def __init__(self, model: str, taps: list[int], dtype: torch.dtype = torch.bfloat16) -> None:
        from models.hf_folder import iter_safetensors, load_hf_config
        from models.llama import LlamaForCausalLM
        from models.loader import decoder_config
        from models.resolve import resolve_model_path

        path = resolve_model_path(model)
        cfg = decoder_config(load_hf_config(path))
        start = max(taps)  # the deepest tapped layer: the fewest layers left to run
        if not 0 <= start < cfg.num_layers:
            raise ValueError(f"the teacher starts after layer {start}; the target has "
                             f"layers 0..{cfg.num_layers - 1}")
        target = LlamaForCausalLM(cfg, cfg.max_position_embeddings)
        target.load_weights(iter_safetensors(path))
        target.layers = target.layers[start + 1 :]  # the layers below are in the stored states
        self.model = target.to(dtype).eval().requires_grad_(False)
        self.dtype = dtype
        self.head = target.lm_head_weight
        i, width = taps.index(start), cfg.hidden_size
        self.columns = slice(i * width, (i + 1) * width)  # its state among the tapped features

    @torch.no_grad()
    def logits(self, feats: torch.Tensor, rows: torch.Tensor,
               head: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[len(rows), V]`` at positions ``rows`` of a sequence with tapped
        features ``feats`` ``[S, taps*H]``; ``head``: rows of the target's LM head to score
        (``Frozen.head``, cut to the draft vocabulary), else all of it."""
        m = self.model
        h = feats[:, self.columns].to(self.dtype)
        s = h.shape[0]
        rope = m.rotary.lookup(torch.arange(s), h.dtype)
        for layer in m.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(rope, layer.input_layernorm(h))
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads,
            )[0]
            h = h + attn.o_proj(out.transpose(0, 1).reshape(s, attn.q_size))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        head = self.head if head is None else head
        return (m.norm(h.index_select(0, rows)).to(head.dtype) @ head.t()).float()


class WeightAverage:
    """An exponential moving average of trainable weights, kept in float32: after every step
    ``avg = decay * avg + (1 - decay) * weight``, starting from the weights it is given (the
    ``--init`` draft's, when continuing), so no bias correction is needed.

    Averaging a continued run's last weights with the draft it started from beat both on
    held-out sets (stages 6 and 7 of the default draft). A running average (decay 0.999) was
    tried on stage 7: it lay between the two, and averaged with the starting draft it was
    below the end-point average on three of four sets (``docs/draft_data.md``, "Twelfth
    step"), so stage 7 ships the end-point average."""

    def __init__(self, params: list[torch.Tensor], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--ema is a decay in (0, 1), got {decay}")
        self.decay = decay
        self.params = params
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - self.decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the trained weights and the average (call again to swap back)."""
        for s, p in zip(self.shadow, self.params):
            trained = p.detach().float().clone()
            p.copy_(s.to(p.dtype))
            s.copy_(trained)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError("the checkpoint's weight average has another parameter count")
        self.shadow = [t.float().clone() for t in state["shadow"]]


def train(args) -> dict:
    torch.set_num_threads(args.threads) if args.threads else None
    frozen, target_cfg = load_frozen(args.model)
    seqs = []
    for folder in args.data:  # validation comes from the last (newest) folder
        val_from = len(seqs)
        seqs += load_sequences(folder, args.taps)
    if args.max_sequences:
        seqs = seqs[: args.max_sequences]
        val_from = min(val_from, len(seqs))
    rng = random.Random(args.seed)
    val, train_seqs = split_sequences(seqs, args.val_sequences, args.seed, args.train_tokens,
                                      val_from)
    if args.vocab_from:
        frozen = frozen.restrict(saved_draft_vocab(args.vocab_from))
    elif args.draft_vocab:
        frozen = frozen.restrict(build_draft_vocab(train_seqs, args.draft_vocab,
                                                   frozen.embed.shape[0]))
    frozen = frozen.with_head_dtype(head_dtype(args, frozen))
    draft, hf = build_draft(args, target_cfg, frozen)
    if args.init:
        init_from(draft, hf, args.init)
    if args.eval_only:
        return evaluate_only(args, draft, frozen, val)
    if not 0 <= args.distill <= 1:
        raise ValueError(f"--distill is a weight in [0, 1], got {args.distill}")
    teacher = Teacher(args.model, args.taps, frozen.head.dtype) if args.distill > 0 else None
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    ema = WeightAverage(params, args.ema) if args.ema else None
    steps_per_epoch = len(train_seqs) // args.batch
    if steps_per_epoch < 1:
        raise ValueError(f"{len(train_seqs)} training sequences do not fill a batch of {args.batch}")
    total = args.steps or steps_per_epoch * args.epochs
    step = 0
    order = list(range(len(train_seqs)))  # this epoch's shuffle (saved: a resumed run keeps it)
    best = 0.0  # best validation simulated acceptance so far; out/draft holds that draft
    ckpt = args.out / "train_state.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt)
        draft.load_state_dict(state["model"])  # includes the trained mask embedding
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        best = state.get("best", 0.0)
        if ema is not None:
            if "ema" not in state:
                raise ValueError(f"{ckpt} has no weight average: resume without --ema")
            ema.load_state_dict(state["ema"])
        rng.setstate(state["rng"])
        if "order" in state:  # checkpoints before the order was saved resume in data order
            if len(state["order"]) != len(train_seqs):
                raise ValueError(f"{ckpt} was trained on {len(state['order'])} sequences, this "
                                 f"run has {len(train_seqs)}: resume with the same data")
            order = list(state["order"])
        print(f"resumed at step {step}/{total}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, dynamic_ncols=True)
    start = time.time()

    def validate() -> dict:
        """Score the validation sequences; keep the draft in out/draft if it is the best yet."""
        nonlocal best
        raw = None
        if ema is not None:
            raw = evaluate(draft, frozen, val, args.anchors, args.gamma)
            ema.swap()
        metrics = evaluate(draft, frozen, val, args.anchors, args.gamma)
        metrics["step"] = step
        if raw is not None:
            metrics.update({f"raw_{key}": value for key, value in raw.items()})
        with (args.out / "history.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if metrics["sim_accept_len"] > best:
            best = metrics["sim_accept_len"]
            save_draft(draft, hf, args.out / "draft", dtype=torch.bfloat16)
        if ema is not None:
            ema.swap()
        shown = "" if raw is None else f" (trained weights: {raw['sim_accept_len']:.3f})"
        bar.write(f"step {step}: val loss {metrics['loss']:.3f}, simulated acceptance "
                  f"{metrics['sim_accept_len']:.3f}{shown} (best {best:.3f})")
        return metrics

    while step < total:
        epoch_pos = step % steps_per_epoch
        if epoch_pos == 0:
            rng.shuffle(order)
        batch = [train_seqs[i] for i in order[epoch_pos * args.batch : (epoch_pos + 1) * args.batch]]
        lr = lr_at(step, total, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        correct = torch.zeros(args.block_size - 1)
        counts = torch.zeros(args.block_size - 1)
        total_loss = 0.0
        for seq in batch:
            anchors = sample_anchors(seq.prompt_len, seq.ids.shape[0], args.anchors, rng)
            if not anchors:
                continue
            loss, c, n, _ = sequence_loss(draft, frozen, seq, anchors, args.gamma,
                                          args.selector_weight, teacher, args.distill)
            (loss / len(batch)).backward()
            total_loss += float(loss.detach()) / len(batch)
            correct += c
            counts += n
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        if ema is not None:
            ema.update()
        step += 1
        acc = (correct / counts.clamp_min(1)).tolist()
        bar.set_postfix(loss=f"{total_loss:.3f}", acc=" ".join(f"{a:.2f}" for a in acc[:4]))
        bar.update(1)
        if args.eval_every and step % args.eval_every == 0 and step < total:
            validate()
        if step % args.save_every == 0 or step == total:
            torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "rng": rng.getstate(), "best": best, "order": order,
                        **({"ema": ema.state_dict()} if ema is not None else {})}, ckpt)
    bar.close()
    elapsed = time.time() - start
    metrics = validate()
    if ema is not None:
        save_draft(draft, hf, args.out / "draft-raw", dtype=torch.bfloat16)
    metrics.update({"best_sim_accept_len": best, "train_seconds": elapsed, "steps": total,
                    "train_sequences": len(train_seqs), "val_sequences": len(val),
                    "train_response_tokens": sum(q.ids.shape[0] - q.prompt_len for q in train_seqs)})
    (args.out / "metrics.json").write_text(json.dumps({"args": _jsonable(vars(args)), **metrics}, indent=2))
    print(json.dumps(metrics, indent=2), flush=True)
    return metrics


def head_dtype(args, frozen: Frozen) -> torch.dtype:
    """``--head-dtype``: named, or (auto) the faster on this machine at this run's shapes."""
    if args.head_dtype != "auto":
        return getattr(torch, args.head_dtype)
    rows = args.anchors * (args.block_size - 1)
    choice, seconds = fastest_head_dtype(frozen.head, rows)
    print(f"head dtype auto: {str(choice).removeprefix('torch.')} (a {rows}-row product and its "
          "gradient: " + ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in seconds.items())
          + ")", flush=True)
    return choice


def evaluate_only(args, draft, frozen: Frozen, val: list[Sequence]) -> dict:
    """``--eval-only``: the ``--init`` draft scored on this run's validation sequences at this
    run's block size (a draft trained with one block size can be compared with another at the
    block it will be served with; the anchors are those every run at that block size scores),
    plus the served mean acceptance length of a greedy walk over each (``served_walk``)."""
    if not args.init:
        raise ValueError("--eval-only scores the --init draft; give --init")
    with torch.no_grad():
        metrics = evaluate(draft, frozen, val, args.anchors, args.gamma)
        walks = [served_walk(draft, frozen, seq) for seq in val]
    metrics["walk_accept_len"] = sum(t for t, _ in walks) / max(1, sum(n for _, n in walks))
    metrics.update({"draft": str(args.init), "block_size": args.block_size,
                    "val_sequences": len(val)})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"eval-block{args.block_size}.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps(metrics, indent=2), flush=True)
    return metrics


def split_sequences(seqs: list[Sequence], val_sequences: int, seed: int,
                    train_tokens: int = 0, val_from: int = 0
                    ) -> tuple[list[Sequence], list[Sequence]]:
    """Validation and training sequences. Validation is ``val_sequences`` (at most a tenth of
    its pool) drawn at random with ``seed`` from ``seqs[val_from:]`` (several data folders: the
    newest one, so validation is new to a draft that trained on the earlier ones); with
    ``train_tokens`` the training side is the other sequences in data order up to that many
    response tokens, so runs with different budgets on the same data share one validation set
    and each larger set contains the smaller ones."""
    order = list(range(val_from, len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = min(val_sequences, len(order) // 10)
    held = set(order[:n_val])
    val = [seqs[i] for i in order[:n_val]]
    if not train_tokens:
        return val, [seqs[i] for i in range(val_from)] + [seqs[i] for i in order[n_val:]]
    train_seqs, tokens = [], 0
    for i, seq in enumerate(seqs):
        if tokens >= train_tokens:
            break
        if i not in held:
            train_seqs.append(seq)
            tokens += seq.ids.shape[0] - seq.prompt_len
    if tokens < train_tokens:
        raise ValueError(f"--train-tokens {train_tokens}: the data holds only {tokens} "
                         "response tokens outside the validation set")
    return val, train_seqs


def _jsonable(d: dict) -> dict:
    def one(v):
        return str(v) if isinstance(v, Path) else [one(x) for x in v] if isinstance(v, list) else v

    return {k: one(v) for k, v in d.items()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="data folders (dflash_data.py's); with several, all train and the "
                        "validation sequences come from the last")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--taps", type=int, nargs="+", default=[1, 14, 27])
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--dflash2", action="store_true",
                   help="train a DFlash2 draft (block convolutions and candidate selector)")
    p.add_argument("--conv-kernel-size", type=int, default=4)
    p.add_argument("--conv-group-size", type=int, default=64)
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--selector-top-k", type=int, default=8)
    p.add_argument("--selector-weight", type=float, default=1.0,
                   help="weight of the selector's cross-entropy next to the draft's (DFlash2)")
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight in [0, 1] of the target's whole next-token distribution in the "
                        "loss, next to its greedy token (recomputed from the deepest tap)")
    p.add_argument("--refine", type=int, default=0,
                   help="refinement passes: after the first pass each block runs again with "
                        "the draft's own greedy guesses in place of MASK (trained and served "
                        "so; each costs one more block pass)")
    p.add_argument("--refine-threshold", type=float, default=0.0,
                   help="a refinement pass takes a guess only where the draft gives it at least "
                        "this probability; other slots stay MASK (0: every guess)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="score only the N most frequent response tokens (0: the full vocabulary)")
    p.add_argument("--vocab-from", type=Path, default=None,
                   help="score the reduced vocabulary of this saved draft (instead of deriving "
                        "--draft-vocab from the data; it takes precedence)")
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=0,
                   help="train this many steps instead of --epochs (equal compute across data sizes)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.0,
                   help="keep an exponential moving average of the weights with this decay "
                        "(e.g. 0.999) and validate and save it (0: off)")
    p.add_argument("--val-sequences", type=int, default=64)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0,
                   help="validate every N steps (0: only at the end); out/draft keeps the best")
    p.add_argument("--head-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="dtype of the frozen LM head's products (its values are bfloat16 "
                        "either way); auto times both at this run's shapes and takes the faster")
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--max-sequences", type=int, default=0, help="use only the first N (sweeps)")
    p.add_argument("--train-tokens", type=int, default=0,
                   help="train on the first sequences (data order, validation excluded) up to "
                        "this many response tokens; validation stays the same (data-size sweeps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--eval-only", action="store_true",
                   help="score the --init draft on the validation split at --block-size; "
                        "no training (writes OUT/eval-block<B>.json)")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this saved draft's weights (same shape; it may add layers, "
                        "change the block size or keep a subset of the taps); the "
                        "draft vocabulary is still derived from this run's data")
    return p


if __name__ == "__main__":
    train(parser().parse_args())
