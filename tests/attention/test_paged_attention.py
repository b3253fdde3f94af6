"""Paged attention through the shared writer and the torch backend equals dense SDPA.

Every case writes K/V through a slot mapping into one layer's pages (block tables shuffled,
last block partial), runs ``TorchBackend.build_metadata(batch).attend(...)`` and compares each
request's output with ``torch.nn.functional.scaled_dot_product_attention`` on the original
float32 K/V (bottom-right causal mask, GQA heads expanded explicitly).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from attention.backends import get_backend
from attention.backends.base import AttentionBatch
from attention.groups import GroupSpec
from attention.kv import LayerKV, write_kv

CPU = torch.device("cpu")
LAYOUTS = ("NHD", "HND")
CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# Tolerances on max|out - ref| / max|ref| against the *original* float32 K/V. Inputs are
# N(0, 1); the output is a softmax-weighted mean of V rows, so its error is of the order of the
# per-element precision of the cache format, amplified a little through the q.k logits.
# Worst cases observed over 20 seeds of the mixed batch (both masks), and the bound used:
# - float32: only summation order differs (padding, kernels): 6e-7 -> 1e-5.
# - float16 (11-bit significand, 2^-11 ~ 5e-4 per element): 1.3e-3 -> 5e-3.
# - bfloat16 (8-bit significand, 2^-8 ~ 4e-3 per element): 7.9e-3 -> 2e-2.
# - fp8 e4m3 (3-bit mantissa, <= 6.25% per element): 0.098 -> 0.15.
# - fp8 e5m2 (2-bit mantissa, <= 12.5% per element): 0.21 -> 0.3.
# Loose bounds alone could hide a small logic error, so every case is also checked to 1e-5
# against SDPA on K/V rounded through the cache format by an independent round trip (observed
# 6e-7 for every dtype); a wrong slot, mask, head mapping or missing scale fails both.
TOL = {
    "float32": 1e-5,
    "float16": 5e-3,
    "bfloat16": 2e-2,
    "fp8_e4m3": 0.15,
    "fp8_e5m2": 0.3,
}
FP8 = ("fp8_e4m3", "fp8_e5m2")


def make_layer(dtype: torch.dtype, layout: str, num_blocks: int, block_size: int,
               kv_heads: int, head_size: int, k_scale: float = 1.0, v_scale: float = 1.0,
               name: str = "layer") -> LayerKV:
    group = GroupSpec(name="target", layers=(name,), block_size=block_size,
                      num_kv_heads=kv_heads, head_size=head_size, dtype=dtype,
                      cache_dtype=str(dtype))
    shape = ((num_blocks, 2, block_size, kv_heads, head_size) if layout == "NHD"
             else (num_blocks, 2, kv_heads, block_size, head_size))
    pages = torch.zeros(shape, dtype=dtype)
    return LayerKV(name=name, group=group, layout=layout, physical=pages,
                   k_scale=k_scale, v_scale=v_scale)


def slots_of(table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    return torch.tensor([table[p // block_size] * block_size + p % block_size
                         for p in range(start, end)], dtype=torch.long)


def roundtrip(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Independent model of what the cache holds: scale, clamp, cast, cast back, unscale."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(dtype).max
        return (x / scale).clamp(-fmax, fmax).to(dtype).to(torch.float32) * scale
    return x.to(dtype).to(torch.float32)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> torch.Tensor:
    """q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` -> ``[Lq, Hq, D]`` (queries at the end of K)."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    rep = hq // hkv
    kx = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    vx = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    mask = None
    if causal:
        qpos = torch.arange(lk - lq, lk)[:, None]
        mask = torch.arange(lk)[None, :] <= qpos
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kx, vx, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@dataclass
class Req:
    ctx: int  # positions already in the cache before this step
    q_len: int  # new tokens this step
    table: list[int]
    k: torch.Tensor  # [ctx + q_len, Hkv, D] float32 (original values)
    v: torch.Tensor
    q: torch.Tensor  # [q_len, Hq, D]

    @property
    def kv_len(self) -> int:
        return self.ctx + self.q_len


def build_requests(shapes: list[tuple[int, int]], num_blocks: int, block_size: int,
                   q_heads: int, kv_heads: int, head_size: int, seed: int,
                   magnitude: float = 1.0) -> list[Req]:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order block tables
    reqs = []
    for ctx, q_len in shapes:
        n = ctx + q_len
        nblk = -(-n // block_size)
        table = [free.pop() for _ in range(nblk)]
        k = torch.randn(n, kv_heads, head_size, generator=gen) * magnitude
        v = torch.randn(n, kv_heads, head_size, generator=gen) * magnitude
        q = torch.randn(q_len, q_heads, head_size, generator=gen)
        reqs.append(Req(ctx, q_len, table, k, v, q))
    return reqs


def run_step(kv: LayerKV, reqs: list[Req], causal: bool, scale: float,
             write_context: bool = True):
    """Write each request's context, then attend its new tokens in one batch."""
    bs = kv.block_size
    if write_context:
        for r in reqs:
            if r.ctx:
                write_kv(kv, r.k[: r.ctx], r.v[: r.ctx], slots_of(r.table, 0, r.ctx, bs))
    batch = AttentionBatch(
        q_lens=tuple(r.q_len for r in reqs),
        kv_lens=tuple(r.kv_len for r in reqs),
        block_tables=tuple(tuple(r.table) for r in reqs),
        slot_mapping=torch.cat([slots_of(r.table, r.ctx, r.kv_len, bs) for r in reqs]),
        causal=causal,
        block_size=bs,
    )
    meta = get_backend("torch", CPU).build_metadata(batch, CPU)
    q = torch.cat([r.q for r in reqs])
    k = torch.cat([r.k[r.ctx:] for r in reqs])
    v = torch.cat([r.v[r.ctx:] for r in reqs])
    out = meta.attend(q, k, v, kv, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    return out, meta


def split(out: torch.Tensor, reqs: list[Req]) -> list[torch.Tensor]:
    return list(out.split([r.q_len for r in reqs]))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check(out: torch.Tensor, reqs: list[Req], causal: bool, scale: float, dtype_name: str,
          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    dtype = CACHE_DTYPES[dtype_name]
    for i, (o, r) in enumerate(zip(split(out, reqs), reqs)):
        assert torch.isfinite(o).all(), f"request {i}: non-finite output"
        ref = dense_reference(r.q, r.k, r.v, causal, scale)
        err = rel_err(o, ref)
        assert err <= TOL[dtype_name], f"request {i} ({r.ctx}+{r.q_len}): rel err {err:.3g}"
        if dtype_name != "float32":
            ref_q = dense_reference(r.q, roundtrip(r.k, dtype, k_scale),
                                    roundtrip(r.v, dtype, v_scale), causal, scale)
            err_q = rel_err(o, ref_q)
            assert err_q <= 1e-5, f"request {i}: rel err vs rounded K/V {err_q:.3g}"


Q_HEADS, KV_HEADS, HEAD = 4, 2, 16  # GQA: 2 query heads per KV head
SCALE = HEAD**-0.5
BS = 8
# (context already cached, new tokens): one long prefill chunk with existing context, three
# decodes of different lengths (one ending exactly on a block boundary), a 4-token verify
# window and a 3-token one (same bucket, padded), and a fresh 9-token prompt.
MIXED = [(19, 21), (7, 1), (15, 1), (33, 1), (10, 4), (5, 3), (0, 9)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype_name", list(CACHE_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_batch_matches_dense(layout: str, dtype_name: str, causal: bool) -> None:
    kv = make_layer(CACHE_DTYPES[dtype_name], layout, 40, BS, KV_HEADS, HEAD)
    reqs = build_requests(MIXED, 40, BS, Q_HEADS, KV_HEADS, HEAD, seed=7)
    out, meta = run_step(kv, reqs, causal, SCALE)
    check(out, reqs, causal, SCALE, dtype_name)
    buckets = getattr(meta, "buckets", None)
    if buckets is not None:  # the scenario is meant to cover several padded buckets
        assert len(buckets) >= 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "shapes",
    [
        [(0, 13)],  # single prefill, last block partial
        [(0, 16)],  # exactly two full blocks
        [(0, 1)],  # one token
        [(15, 1), (7, 1)],  # decodes, uniform q, different kv lengths
        [(15, 1), (15, 1)],  # decodes whose range fills the blocks exactly (no mask needed)
        [(3, 5), (9, 5), (0, 5)],  # uniform multi-token windows
        [(4, 3), (2, 5), (11, 6)],  # one padded bucket
        [(0, 40), (1, 1), (2, 2), (0, 3), (30, 7)],  # wide spread of q lengths
    ],
    ids=["prefill13", "prefill16", "one", "decodes", "full-blocks", "windows", "padded",
         "spread"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_shapes_float32(layout: str, shapes, causal: bool) -> None:
    kv = make_layer(torch.float32, layout, 24, BS, KV_HEADS, HEAD)
    reqs = build_requests(shapes, 24, BS, Q_HEADS, KV_HEADS, HEAD, seed=len(shapes))
    out, _ = run_step(kv, reqs, causal, SCALE)
    check(out, reqs, causal, SCALE, "float32")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_heads, kv_heads, head, block_size",
                         [(9, 3, 64, 16), (8, 2, 128, 128), (6, 1, 64, 4), (4, 4, 128, 16)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_bf16_pages_head_sizes_64_and_128(layout, q_heads, kv_heads, head, block_size,
                                          causal) -> None:
    """bfloat16 pages with head size 64/128 (the kernel converts K/V in registers and computes
    the rows of a kv head in groups): decodes, verify windows and prefill chunks of lengths
    that end inside and on 16-position blocks, against dense attention on the rounded K/V."""
    shapes = [(0, 1), (15, 1), (16, 1), (47, 1), (300, 1), (40, 8), (63, 8), (0, 37), (21, 19)]
    nblk = sum(-(-(c + q) // block_size) for c, q in shapes)
    kv = make_layer(torch.bfloat16, layout, nblk, block_size, kv_heads, head)
    reqs = build_requests(shapes, nblk, block_size, q_heads, kv_heads, head, seed=head)
    out, _ = run_step(kv, reqs, causal, head**-0.5)
    check(out, reqs, causal, head**-0.5, "bfloat16")
    # a bfloat16 query (the engine's case; with AVX512-BF16 the scores come from bfloat16 dot
    # products): against dense attention on the rounded query, K and V, to bfloat16 output
    for r in reqs:
        r.q = r.q.to(torch.bfloat16)
    out, _ = run_step(kv, reqs, causal, head**-0.5, write_context=False)
    for i, (o, r) in enumerate(zip(split(out, reqs), reqs)):
        ref = dense_reference(r.q.float(), roundtrip(r.k, torch.bfloat16, 1.0),
                              roundtrip(r.v, torch.bfloat16, 1.0), causal, head**-0.5)
        err = rel_err(o.float(), ref)
        assert err < 1e-2, f"request {i} ({r.ctx}+{r.q_len}), bf16 query: rel err {err:.3g}"


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_gqa_ratios(q_heads: int, kv_heads: int) -> None:
    kv = make_layer(torch.float32, "HND", 16, 4, kv_heads, 8)
    reqs = build_requests([(6, 3), (0, 5), (9, 1)], 16, 4, q_heads, kv_heads, 8, seed=3)
    out, _ = run_step(kv, reqs, True, 8**-0.5)
    check(out, reqs, True, 8**-0.5, "float32")


def test_gqa_head_mapping_is_grouped_not_interleaved() -> None:
    """Query head h must read KV head h // (Hq/Hkv). Make KV heads very different so a wrong
    mapping cannot pass: KV head 0 carries V = +1, KV head 1 carries V = -1."""
    kv = make_layer(torch.float32, "NHD", 4, 4, 2, 4)
    k = torch.zeros(3, 2, 4)
    v = torch.stack([torch.ones(3, 4), -torch.ones(3, 4)], dim=1)
    q = torch.randn(1, 4, 4)
    # positions 0..1 already cached in block 2 (slots 8, 9); the new token goes to slot 10
    write_kv(kv, k[:2], v[:2], torch.tensor([8, 9]))
    batch = AttentionBatch(q_lens=(1,), kv_lens=(3,), block_tables=((2,),),
                           slot_mapping=torch.tensor([10]), causal=True, block_size=4)
    out = get_backend("torch", CPU).build_metadata(batch, CPU).attend(q, k[2:], v[2:], kv, 0.5)
    expected = torch.tensor([1.0, 1.0, -1.0, -1.0])
    torch.testing.assert_close(out[0, :, 0], expected)


@pytest.mark.parametrize("dtype_name", FP8)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_uses_per_layer_scales(layout: str, dtype_name: str) -> None:
    """K/V of magnitude ~200 overflow e4m3 (max 448) unless divided by the layer's scale,
    and read back wrong unless multiplied by it again."""
    dtype = CACHE_DTYPES[dtype_name]
    k_scale, v_scale = 2.0, 4.0
    kv = make_layer(dtype, layout, 40, BS, KV_HEADS, HEAD, k_scale, v_scale)
    reqs = build_requests(MIXED, 40, BS, Q_HEADS, KV_HEADS, HEAD, seed=11, magnitude=200.0)
    scale = SCALE / 200.0  # keep logits O(1)
    out, _ = run_step(kv, reqs, True, scale)
    check(out, reqs, True, scale, dtype_name, k_scale, v_scale)
    # the pages hold the scaled values
    r = reqs[0]
    stored = kv.logical[r.table[0], 0, 0].to(torch.float32)
    torch.testing.assert_close(stored, roundtrip(r.k[0], dtype, k_scale) / k_scale)


def test_fp8_clamps_instead_of_overflowing() -> None:
    kv = make_layer(torch.float8_e4m3fn, "NHD", 2, 4, 1, 4)
    k = torch.tensor([[[1000.0, -1000.0, 3.0, 0.0]]])
    write_kv(kv, k, k, torch.tensor([5]))
    stored = kv.logical[1, 0, 1, 0].to(torch.float32)
    assert torch.isfinite(stored).all()
    torch.testing.assert_close(stored, torch.tensor([448.0, -448.0, 3.0, 0.0]))


@pytest.mark.parametrize("dtype_name", list(CACHE_DTYPES))
def test_writer_places_tokens_at_slots_in_both_layouts(dtype_name: str) -> None:
    """Position p of a request lives at ``table[p // bs] * bs + p % bs``; NHD stores it as
    ``[blk, kv, off, h]`` and HND as ``[blk, kv, h, off]`` in physical memory."""
    dtype = CACHE_DTYPES[dtype_name]
    bs, h, d = 4, 3, 8
    table = [5, 2, 7]
    k = torch.randn(10, h, d) * 0.5
    v = torch.randn(10, h, d) * 0.5
    pages = {}
    for layout in LAYOUTS:
        kv = make_layer(dtype, layout, 8, bs, h, d)
        write_kv(kv, k, v, slots_of(table, 0, 10, bs))
        assert kv.physical.is_contiguous()
        for p in range(10):
            blk, off = table[p // bs], p % bs
            for hh in range(h):
                if layout == "NHD":
                    got_k, got_v = kv.physical[blk, 0, off, hh], kv.physical[blk, 1, off, hh]
                else:
                    got_k, got_v = kv.physical[blk, 0, hh, off], kv.physical[blk, 1, hh, off]
                assert torch.equal(got_k.float(), roundtrip(k[p, hh], dtype, 1.0))
                assert torch.equal(got_v.float(), roundtrip(v[p, hh], dtype, 1.0))
        # nothing else was touched
        used = torch.zeros(8, dtype=torch.bool)
        used[table] = True
        assert (kv.physical[~used].float() == 0).all()
        assert (kv.logical[7, :, 2:].float() == 0).all()  # unused tail of the last block
        pages[layout] = kv
    assert torch.equal(pages["NHD"].logical.float(), pages["HND"].logical.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_writer_matches_the_python_writer(layout: str, dtype: torch.dtype) -> None:
    """K/V already in the cache dtype go through the compiled copy (``store_kv``); V as the
    strided view the QKV projection hands over; the pages equal those of the Python writer."""
    from attention import cpu_kernel
    from attention.kv import _store_ops

    if not cpu_kernel.available():
        pytest.skip("CPU kernels not built here")
    bs, h, d = 4, 3, 8
    qkv = torch.randn(11, 2 * h + 2, d).to(dtype)
    k, v = qkv[:, 2 : 2 + h], qkv[:, 2 + h :]  # views: k strided over heads of the row, v too
    slots = slots_of([6, 1, 3], 1, 12, bs)
    fast, slow = make_layer(dtype, layout, 8, bs, h, d), make_layer(dtype, layout, 8, bs, h, d)
    with torch.inference_mode():
        assert _store_ops(fast, k, v) is not None
        write_kv(fast, k, v, slots)
    with torch.enable_grad():  # the Python path (the compiled one records no gradient)
        assert _store_ops(slow, k, v) is None
        write_kv(slow, k, v, slots)
    assert torch.equal(fast.physical, slow.physical) and fast.physical.abs().sum() > 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernel.load().store_kv(fast.logical, k[:1], v[:1], torch.tensor([8]),
                                   torch.tensor([0]))


def test_writer_skips_negative_slots() -> None:
    """ref/kvcache.md 6.4: the shared writer skips slots < 0 (padding tokens). Slot -1 must not
    land in the last block of the pool."""
    kv = make_layer(torch.float32, "NHD", 3, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    write_kv(kv, k, k, torch.tensor([0, -1, 1]))
    assert (kv.logical[0, :, :2] == 1).all()
    assert (kv.logical[1:] == 0).all(), "slot -1 was written into the pool"


@pytest.mark.parametrize("dtype_name", list(CACHE_DTYPES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_layouts_give_identical_results(dtype_name: str, causal: bool) -> None:
    outs = []
    for layout in LAYOUTS:
        kv = make_layer(CACHE_DTYPES[dtype_name], layout, 40, BS, KV_HEADS, HEAD)
        reqs = build_requests(MIXED, 40, BS, Q_HEADS, KV_HEADS, HEAD, seed=5)
        out, _ = run_step(kv, reqs, causal, SCALE)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_step_reads_earlier_writes(layout: str, dtype_name: str) -> None:
    """Several engine-like steps on one pool: prefill chunks, decodes and verify windows whose
    rejected positions are rolled back by length and later overwritten. Every step attends
    only through K/V written by earlier ``attend`` calls (no direct context writes)."""
    dtype = CACHE_DTYPES[dtype_name]
    bs, num_blocks = 4, 64
    kv = make_layer(dtype, layout, num_blocks, bs, KV_HEADS, HEAD)
    gen = torch.Generator().manual_seed(99)
    rng = random.Random(99)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # accepted K/V per request (what a dense model would see), and its block table
    hist_k = {r: torch.empty(0, KV_HEADS, HEAD) for r in "abc"}
    hist_v = {r: torch.empty(0, KV_HEADS, HEAD) for r in "abc"}
    tables: dict[str, list[int]] = {r: [] for r in "abc"}
    # per step: request -> (new tokens, how many of them are kept afterwards)
    steps = [
        {"a": (6, 6), "b": (3, 3)},  # prefill a, first chunk of b
        {"a": (1, 1), "b": (7, 7), "c": (2, 2)},  # decode a, rest of b, start c
        {"a": (4, 2), "b": (1, 1), "c": (5, 5)},  # verify window for a: 2 of 4 kept
        {"a": (3, 1), "b": (4, 4), "c": (1, 1)},  # a rejects all drafts but the first
        {"a": (1, 1), "b": (1, 1), "c": (3, 3)},
    ]
    for step_no, step in enumerate(steps):
        reqs, names = [], []
        for name, (n_new, _) in step.items():
            ctx = hist_k[name].shape[0]
            end = ctx + n_new
            while len(tables[name]) * bs < end:
                tables[name].append(free.pop())
            k_new = torch.randn(n_new, KV_HEADS, HEAD, generator=gen)
            v_new = torch.randn(n_new, KV_HEADS, HEAD, generator=gen)
            q_new = torch.randn(n_new, Q_HEADS, HEAD, generator=gen)
            reqs.append(Req(ctx, n_new, list(tables[name]),
                            torch.cat([hist_k[name], k_new]), torch.cat([hist_v[name], v_new]),
                            q_new))
            names.append(name)
        out, _ = run_step(kv, reqs, True, SCALE, write_context=False)
        try:
            check(out, reqs, True, SCALE, dtype_name)
        except AssertionError as exc:
            raise AssertionError(f"step {step_no}: {exc}") from exc
        for name, r in zip(names, reqs):
            keep = r.ctx + step[name][1]
            hist_k[name], hist_v[name] = r.k[:keep], r.v[:keep]
