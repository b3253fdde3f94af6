"""The paged CPU kernel: accuracy against dense SDPA, and bitwise invariance.

Bitwise properties (``torch.equal``, not a tolerance):
- a request's output rows are the same alone and inside batches of 2, 8 and 32 whose other
  requests have different context and query lengths (decodes, verify blocks, prefill chunks);
- a verify block (q_len = K + 1, causal) gives, row for row, what K + 1 separate decode steps
  give, and a prefill chunk gives what any other chunking of the same prompt gives;
- results do not depend on the number of threads or the KV layout.
"""

from __future__ import annotations

import random

import pytest
import torch

from attention import cpu_kernel
from attention.backends.base import AttentionBatch
from attention.backends.torch_backend import TorchBackend

from test_paged_attention import (
    BS, CACHE_DTYPES, HEAD, KV_HEADS, LAYOUTS, Q_HEADS, SCALE, Req, build_requests, check,
    make_layer, slots_of,
)
from attention.kv import write_kv

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason=f"paged kernel unavailable: {cpu_kernel.error()}")
PAGED = TorchBackend("paged")


def attend(kv, reqs: list[Req], causal: bool, scale: float = SCALE,
           q_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Write every request's context, attend its new tokens in one paged batch; per-request
    outputs."""
    bs = kv.block_size
    for r in reqs:
        if r.ctx:
            write_kv(kv, r.k[: r.ctx], r.v[: r.ctx], slots_of(r.table, 0, r.ctx, bs))
    batch = AttentionBatch(
        q_lens=tuple(r.q_len for r in reqs), kv_lens=tuple(r.kv_len for r in reqs),
        block_tables=tuple(tuple(r.table) for r in reqs),
        slot_mapping=torch.cat([slots_of(r.table, r.ctx, r.kv_len, bs) for r in reqs]),
        causal=causal, block_size=bs,
    )
    meta = PAGED.build_metadata(batch, CPU)
    q = torch.cat([r.q for r in reqs]).to(q_dtype)
    k = torch.cat([r.k[r.ctx:] for r in reqs]).to(q_dtype)
    v = torch.cat([r.v[r.ctx:] for r in reqs]).to(q_dtype)
    out = meta.attend(q, k, v, kv, scale)
    assert out.dtype == q_dtype
    return list(out.split([r.q_len for r in reqs]))


MIXED = [(19, 21), (7, 1), (15, 1), (33, 1), (10, 4), (5, 3), (0, 9), (16, 8), (47, 1)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype_name", list(CACHE_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_matches_dense(layout, dtype_name, causal):
    kv = make_layer(CACHE_DTYPES[dtype_name], layout, 64, BS, KV_HEADS, HEAD)
    reqs = build_requests(MIXED, 64, BS, Q_HEADS, KV_HEADS, HEAD, seed=17)
    out = torch.cat(attend(kv, reqs, causal))
    check(out, reqs, causal, SCALE, dtype_name)


@pytest.mark.parametrize("q_heads,kv_heads,head", [(4, 4, 16), (8, 2, 8), (6, 1, 24), (9, 3, 64),
                                                   (2, 1, 20)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_paged_gqa_and_head_sizes(q_heads, kv_heads, head, causal):
    kv = make_layer(torch.float32, "HND", 48, 4, kv_heads, head)
    reqs = build_requests([(6, 3), (0, 5), (9, 1), (30, 8), (3, 17)], 48, 4, q_heads, kv_heads,
                          head, seed=3)
    out = torch.cat(attend(kv, reqs, causal, head**-0.5))
    check(out, reqs, causal, head**-0.5, "float32")


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_paged_low_precision_queries(dtype_name):
    """bf16/fp16 queries (the model dtype) are read and written by the kernel directly."""
    dtype = CACHE_DTYPES[dtype_name]
    kv = make_layer(dtype, "NHD", 64, BS, KV_HEADS, HEAD)
    reqs = build_requests(MIXED, 64, BS, Q_HEADS, KV_HEADS, HEAD, seed=5)
    outs = attend(kv, reqs, True, q_dtype=dtype)
    for o, r in zip(outs, reqs):
        from test_paged_attention import dense_reference, rel_err, roundtrip
        ref = dense_reference(r.q.to(dtype).float(), roundtrip(r.k, dtype, 1.0),
                              roundtrip(r.v, dtype, 1.0), True, SCALE)
        assert rel_err(o.float(), ref) < 1e-2


def _random_mates(rng: random.Random, count: int, long_ctx: bool) -> list[tuple[int, int]]:
    shapes = []
    for _ in range(count):
        kind = rng.random()
        q_len = 1 if kind < 0.5 else (rng.choice([4, 8]) if kind < 0.8 else rng.randint(9, 40))
        ctx = rng.randint(0, 300 if long_ctx else 60)
        shapes.append((ctx, q_len))
    return shapes


# (q heads, kv heads, head size, block size) that take the kernel's register path for bfloat16
# pages (head size 64 or 128): SmolLM2's 9/3 heads, a Llama-8B-like 4:1 group, one kv head for
# six query heads; pages of 16 and 128 positions (one page per 16-position block) and of 4
# (a block spans pages).
GEOMETRIES = [(9, 3, 64, 16), (8, 2, 128, 128), (6, 1, 64, 4)]
DEFAULT = (Q_HEADS, KV_HEADS, HEAD, BS)


def _alone_and_in_batches(layout, dtype_name, causal, geometry) -> None:
    q_heads, kv_heads, head, bs = geometry
    dtype = CACHE_DTYPES[dtype_name]
    q_dtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    rng = random.Random(123)
    for target_shape in [(57, 1), (90, 8), (33, 24)]:
        outs = []
        for size in (1, 2, 8, 32):
            shapes = _random_mates(rng, size - 1, long_ctx=size == 32)
            pos = rng.randint(0, size - 1)
            shapes.insert(pos, target_shape)
            nblk = sum(-(-(c + q) // bs) for c, q in shapes) + 4
            kv = make_layer(dtype, layout, nblk, bs, kv_heads, head)
            reqs = build_requests(shapes, nblk, bs, q_heads, kv_heads, head, seed=size)
            # the target request carries the same data in every batch
            gen = torch.Generator().manual_seed(99)
            c, q = target_shape
            mine = reqs[pos]
            reqs[pos] = Req(c, q, mine.table, torch.randn(c + q, kv_heads, head, generator=gen),
                            torch.randn(c + q, kv_heads, head, generator=gen),
                            torch.randn(q, q_heads, head, generator=gen))
            outs.append(attend(kv, reqs, causal, head**-0.5, q_dtype=q_dtype)[pos])
        for size, o in zip((2, 8, 32), outs[1:]):
            assert torch.equal(o, outs[0]), f"{target_shape}: differs in a batch of {size}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype_name", list(CACHE_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_request_bitwise_same_alone_and_in_batches(layout, dtype_name, causal, threads):
    """One decode row, one verify block and one prefill chunk, each alone and inside batches of
    2, 8 and 32 (other requests of other lengths, before and after it)."""
    torch.set_num_threads(threads)  # the conftest fixture restores the count
    _alone_and_in_batches(layout, dtype_name, causal, DEFAULT)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_register_path_bitwise_same_alone_and_in_batches(layout, causal, geometry):
    """The same property where rows of one kv head are computed in groups (bfloat16 pages, head
    size 64/128): a row's group mates change from batch to batch, its result must not."""
    _alone_and_in_batches(layout, "bfloat16", causal, geometry)


def _verify_equals_decode(layout, dtype_name, geometry) -> None:
    q_heads, kv_heads, head, bs = geometry
    dtype = CACHE_DTYPES[dtype_name]
    q_dtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    total, K = 70, 7
    # rounded through the query dtype, so a context rewrite stores what the step wrote
    k = torch.randn(total, kv_heads, head, generator=gen).to(q_dtype).float()
    v = torch.randn(total, kv_heads, head, generator=gen).to(q_dtype).float()
    q = torch.randn(total, q_heads, head, generator=gen)
    own = -(-total // bs)
    table = list(range(own))[::-1]
    mate_blocks = -(-(60 + 40) // bs)

    def run(chunks: list[int], mates: int) -> torch.Tensor:
        """Feed the sequence in the given chunks (each its own step, with other requests in the
        batch), return the output of every position."""
        kv = make_layer(dtype, layout, own + mate_blocks * mates, bs, kv_heads, head)
        rows, start = [], 0
        rng = random.Random(len(chunks))
        for n in chunks:
            end = start + n
            me = Req(start, n, table, k[:end], v[:end], q[start:end])
            others = build_requests(_random_mates(rng, mates, False), 10**5, bs, q_heads,
                                    kv_heads, head, seed=end) if mates else []
            free = list(range(own, own + mate_blocks * mates))
            for o in others:
                o.table = [free.pop() for _ in range(-(-o.kv_len // bs))]
            reqs = others[: len(others) // 2] + [me] + others[len(others) // 2:]
            # only the new tokens of `me` are written by attend; its context is already there
            out = attend(kv, [me] if not others else reqs, True, head**-0.5, q_dtype=q_dtype)
            rows.append(out[reqs.index(me) if others else 0])
            start = end
        return torch.cat(rows)

    decode = run([1] * total, mates=0)
    p = total - K - 1
    verify = run([p, K + 1], mates=5)  # prefill, then a verify block of K+1, in a batch
    assert torch.equal(verify[p:], decode[p:]), "verify rows differ from decode rows"
    assert torch.equal(verify[:p], decode[:p]), "prefill rows differ from decode rows"
    chunked = run([13, 29, 1, 19, 8], mates=3)
    assert torch.equal(chunked, decode), "chunked prefill differs"


@pytest.mark.parametrize("dtype_name", list(CACHE_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_rows_equal_decode_rows(layout, dtype_name):
    """Positions p..p+K verified in one causal block equal the same positions decoded one at a
    time, bitwise; so do a prefill in one chunk and the same prompt in other chunkings."""
    _verify_equals_decode(layout, dtype_name, DEFAULT)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_register_path_verify_rows_equal_decode_rows(layout, geometry):
    _verify_equals_decode(layout, "bfloat16", geometry)


def test_layouts_and_threads_bitwise_equal():
    outs = []
    for layout in LAYOUTS:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            kv = make_layer(torch.bfloat16, layout, 64, BS, KV_HEADS, HEAD)
            reqs = build_requests(MIXED, 64, BS, Q_HEADS, KV_HEADS, HEAD, seed=1)
            outs.append(torch.cat(attend(kv, reqs, True, q_dtype=torch.bfloat16)))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_kernel_rejects_bad_lengths():
    kv = make_layer(torch.float32, "NHD", 4, 4, 1, 8)
    tables = torch.tensor([[0, 1]])
    q = torch.randn(3, 1, 8)
    with pytest.raises(RuntimeError, match="kv_len"):
        cpu_kernel.paged_attention(q, kv.logical, tables, torch.tensor([0, 3]), torch.tensor([2]),
                                   True, 1.0)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_kernel.paged_attention(q, kv.logical, tables, torch.tensor([0, 3]),
                                   torch.tensor([12]), True, 1.0)


def test_a_stale_build_lock_is_removed(tmp_path):
    import os
    import time

    from attention import cpu_kernel

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_kernel._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    cpu_kernel._clear_stale_lock(tmp_path)
    assert not lock.exists()
