"""Tree masks (``AttentionBatch.tree_masks``): verifying a tree of draft tokens in one step.

A tree request stores node ``j`` of its draft tree at slot ``base + j``; the node's row sees
the context ``[0, base)``, its ancestors and itself. The paged CPU kernel must give each tree
row bitwise what a plain causal (chain) row gives when the node's ancestors' K/V sit at the
consecutive positions ``base, base + 1, ...`` (the last row of a causal request whose new tokens
are the root-to-node path): that is what makes tree decoding emit exactly the tokens plain
decoding emits. The SDPA path is checked to a tolerance against the same chain reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from attention import cpu_kernel
from attention.backends.base import AttentionBatch
from attention.backends.torch_backend import TorchBackend
from attention.kv import write_kv

from test_paged_attention import CACHE_DTYPES, make_layer, slots_of

CPU = torch.device("cpu")
PAGED = TorchBackend("paged")
SDPA = TorchBackend("sdpa")
needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason=f"paged kernel unavailable: {cpu_kernel.error()}")

# node 0 is the root; depths 0, 1, 1, 2, 2, 2; masks 0b1, 0b11 (both plain causal rows),
# 0b101, 0b1011, 0b10101, 0b100011
TREE6 = [-1, 0, 0, 1, 2, 1]
# deeper and wider: depths up to 5, siblings at far apart offsets
TREE12 = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 4, 8, 5]


def ancestors(parents: list[int], j: int) -> list[int]:
    """Root-to-node path of node ``j`` (ancestors in depth order, then ``j``)."""
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


def tree_masks(parents: list[int]) -> torch.Tensor:
    return torch.tensor([sum(1 << a for a in ancestors(parents, j)) for j in range(len(parents))],
                        dtype=torch.long)


@dataclass
class Step:
    """One request of a step: ``k``/``v`` cover its whole range (context, then new tokens)."""
    ctx: int
    q: torch.Tensor  # [q_len, Hq, D]
    k: torch.Tensor  # [ctx + q_len, Hkv, D]
    v: torch.Tensor
    masks: torch.Tensor | None = None  # [q_len] int64
    table: list[int] | None = None

    @property
    def q_len(self) -> int:
        return self.q.shape[0]

    @property
    def kv_len(self) -> int:
        return self.ctx + self.q_len


def run(backend: TorchBackend, kv, reqs: list[Step], scale: float,
        with_masks: bool = True) -> list[torch.Tensor]:
    """Give each request fresh blocks (in a shuffled order), write its context, attend its new
    tokens in one batch; per-request outputs. ``tree_masks`` is passed when any request has
    masks (zeros for the others) and ``with_masks``."""
    bs = kv.block_size
    free = list(range(kv.physical.shape[0]))
    random.Random(len(reqs)).shuffle(free)
    for r in reqs:
        r.table = [free.pop() for _ in range(-(-r.kv_len // bs))]
        if r.ctx:
            write_kv(kv, r.k[: r.ctx], r.v[: r.ctx], slots_of(r.table, 0, r.ctx, bs))
    masks = None
    if with_masks and any(r.masks is not None for r in reqs):
        masks = torch.cat([r.masks if r.masks is not None
                           else torch.zeros(r.q_len, dtype=torch.long) for r in reqs])
    batch = AttentionBatch(
        q_lens=tuple(r.q_len for r in reqs), kv_lens=tuple(r.kv_len for r in reqs),
        block_tables=tuple(tuple(r.table) for r in reqs),
        slot_mapping=torch.cat([slots_of(r.table, r.ctx, r.kv_len, bs) for r in reqs]),
        causal=True, block_size=bs, tree_masks=masks,
    )
    meta = backend.build_metadata(batch, CPU)
    q = torch.cat([r.q for r in reqs])
    k = torch.cat([r.k[r.ctx:] for r in reqs])
    v = torch.cat([r.v[r.ctx:] for r in reqs])
    out = meta.attend(q, k, v, kv, scale)
    assert out.dtype == q.dtype
    return list(out.split([r.q_len for r in reqs]))


def tree_case(parents: list[int], base: int, q_heads: int, kv_heads: int, head: int,
              q_dtype: torch.dtype, seed: int) -> tuple[Step, list[Step]]:
    """The tree request and, per node, its chain request (context + root-to-node path as new
    tokens; the node's row is the last one). K/V are rounded through the query dtype, as the
    engine's K/V are, so the context and the new tokens store the same values."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    k = torch.randn(base + n, kv_heads, head, generator=gen).to(q_dtype)
    v = torch.randn(base + n, kv_heads, head, generator=gen).to(q_dtype)
    q = torch.randn(n, q_heads, head, generator=gen).to(q_dtype)
    tree = Step(base, q, k, v, tree_masks(parents))
    chains = []
    for j in range(n):
        path = ancestors(parents, j)
        idx = torch.tensor(list(range(base)) + [base + a for a in path])
        chains.append(Step(base, q[path], k[idx], v[idx]))
    return tree, chains


def mates(q_heads: int, kv_heads: int, head: int, q_dtype: torch.dtype, seed: int) -> list[Step]:
    """Plain requests to share the batch: decodes, a verify block, a prefill chunk."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for ctx, q_len in [(20, 1), (0, 19), (53, 1), (31, 5)]:
        n = ctx + q_len
        out.append(Step(ctx, torch.randn(q_len, q_heads, head, generator=gen).to(q_dtype),
                        torch.randn(n, kv_heads, head, generator=gen).to(q_dtype),
                        torch.randn(n, kv_heads, head, generator=gen).to(q_dtype)))
    return out


def blocks_for(reqs: list[Step], bs: int) -> int:
    return sum(-(-r.kv_len // bs) for r in reqs) + 2


# (cache dtype, query dtype, q heads, kv heads, head size, block size): the kernel's paths
CASES = {
    # bfloat16 pages, head 64, bfloat16 query: the register path (bfloat16 dot products where
    # the CPU has AVX512-BF16), rows of a kv head in groups
    "bf16-bf16-d64": ("bfloat16", torch.bfloat16, 9, 3, 64, 16),
    # bfloat16 pages, float32 query: the register path with float scores
    "bf16-f32-d128": ("bfloat16", torch.float32, 4, 2, 128, 16),
    # buffered K/V, 16-lane scores (qk_generic), pages smaller than a 16-position block
    "f32-d32": ("float32", torch.float32, 4, 2, 32, 4),
    # buffered, head size 64 (qk_block)
    "f16-d64": ("float16", torch.float16, 6, 1, 64, 8),
    # buffered, head size not a multiple of 16 (scalar scores on transposed K)
    "f32-d20": ("float32", torch.float32, 2, 1, 20, 8),
    # fp8 pages with per-layer scales
    "fp8-d32": ("fp8_e4m3", torch.float32, 4, 2, 32, 16),
}


@needs_kernel
@pytest.mark.parametrize("base", [37, 300])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", list(CASES))
def test_tree_rows_bitwise_equal_chain_rows(case, layout, base):
    dtype_name, q_dtype, hq, hkv, head, bs = CASES[case]
    scales = (0.5, 0.25) if dtype_name.startswith("fp8") else (1.0, 1.0)
    parents = TREE12 if base == 300 else TREE6
    tree, chains = tree_case(parents, base, hq, hkv, head, q_dtype, seed=base + head)
    others = mates(hq, hkv, head, q_dtype, seed=head)
    # the tree request between plain ones; the chains in a batch of their own
    batch = others[:2] + [tree] + others[2:]
    kv = make_layer(CACHE_DTYPES[dtype_name], layout, blocks_for(batch, bs), bs, hkv, head,
                    *scales)
    got = run(PAGED, kv, batch, head**-0.5)[2]
    kv = make_layer(CACHE_DTYPES[dtype_name], layout, blocks_for(chains, bs), bs, hkv, head,
                    *scales)
    ref = torch.stack([o[-1] for o in run(PAGED, kv, chains, head**-0.5)])
    assert torch.isfinite(got.float()).all()
    for j in range(len(parents)):
        assert torch.equal(got[j], ref[j]), f"node {j} (path {ancestors(parents, j)}) differs"


@needs_kernel
@pytest.mark.parametrize("case", ["bf16-bf16-d64", "f32-d32"])
def test_a_63_node_tree_across_query_tiles(case):
    """The largest tree (63 nodes: bit 62 is the last offset), random parents among the few
    nodes before each, so the rows span several 16-row query tiles and the logical positions
    of deep nodes are far from their slots."""
    dtype_name, q_dtype, hq, hkv, head, bs = CASES[case]
    rng = random.Random(8)
    parents = [-1] + [rng.randint(max(0, j - 6), j - 1) for j in range(1, 63)]
    tree, chains = tree_case(parents, 21, hq, hkv, head, q_dtype, seed=8)
    assert int(tree.masks[62]) >> 62 == 1
    dtype = CACHE_DTYPES[dtype_name]
    got = run(PAGED, make_layer(dtype, "NHD", blocks_for([tree], bs), bs, hkv, head), [tree],
              head**-0.5)[0]
    kv = make_layer(dtype, "NHD", blocks_for(chains, bs), bs, hkv, head)
    ref = torch.stack([o[-1] for o in run(PAGED, kv, chains, head**-0.5)])
    for j in range(len(parents)):
        assert torch.equal(got[j], ref[j]), f"node {j} (path {ancestors(parents, j)}) differs"


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["bf16-bf16-d64", "f32-d32"])
def test_batch_invariance_with_a_tree_request(case, threads):
    """Plain requests give the same bits with and without a tree request in their batch, and
    the tree request gives the same bits alone and in the batch."""
    torch.set_num_threads(threads)  # the conftest fixture restores the count
    dtype_name, q_dtype, hq, hkv, head, bs = CASES[case]
    tree, _ = tree_case(TREE12, 45, hq, hkv, head, q_dtype, seed=1)
    others = mates(hq, hkv, head, q_dtype, seed=2)
    dtype = CACHE_DTYPES[dtype_name]

    def go(reqs):
        return run(PAGED, make_layer(dtype, "NHD", blocks_for(reqs, bs), bs, hkv, head), reqs,
                   head**-0.5)

    plain = go(others)
    mixed = go(others[:1] + [tree] + others[1:])
    alone = go([tree])[0]
    for i, o in enumerate(plain):
        assert torch.equal(mixed[i + (i >= 1)], o), f"plain request {i} changed"
    assert torch.equal(mixed[1], alone)


@pytest.mark.parametrize("backend", ["paged", "sdpa"])
@pytest.mark.parametrize("case", ["bf16-bf16-d64", "f32-d20"])
def test_zero_and_contiguous_masks_are_causal(case, backend):
    """Masks of 0 and masks of bits 0..i are the plain causal rule (the paged kernel: bitwise;
    SDPA, whose single-request and mask-free shortcuts a tree mask turns off: to rounding)."""
    if backend == "paged" and not cpu_kernel.available():
        pytest.skip("paged kernel unavailable")
    dtype_name, q_dtype, hq, hkv, head, bs = CASES[case]
    chain = list(range(-1, 7))  # a chain of 8 nodes: masks 0b1, 0b11, ..., 0b11111111
    tree, _ = tree_case(chain, 29, hq, hkv, head, q_dtype, seed=3)
    assert tree.masks.tolist() == [(2 << i) - 1 for i in range(8)]
    others = mates(hq, hkv, head, q_dtype, seed=4)
    dtype = CACHE_DTYPES[dtype_name]
    outs = []
    for masks in (None, torch.zeros(8, dtype=torch.long), tree.masks,
                  torch.tensor([0, 3, 0, 15, 0, 0, 127, 0])):
        reqs = others[:1] + [Step(tree.ctx, tree.q, tree.k, tree.v, masks)] + others[1:]
        kv = make_layer(dtype, "HND", blocks_for(reqs, bs), bs, hkv, head)
        outs.append(run(PAGED if backend == "paged" else SDPA, kv, reqs, head**-0.5))
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            if backend == "paged":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", [37, 300])
def test_sdpa_tree_rows_match_chain_rows(base):
    """The SDPA path (``SPECSERVE_CPU_ATTENTION=sdpa``, CUDA): tree rows equal the chain rows
    to rounding, in a bucket with other requests and alone (the single-request shortcuts must
    not drop the mask)."""
    hq, hkv, head, bs = 4, 2, 32, 8
    parents = TREE12 if base == 300 else TREE6
    tree, chains = tree_case(parents, base, hq, hkv, head, torch.float32, seed=base)
    others = mates(hq, hkv, head, torch.float32, seed=5)
    chain_kv = make_layer(torch.float32, "NHD", blocks_for(chains, bs), bs, hkv, head)
    ref = torch.stack([o[-1] for o in run(SDPA, chain_kv, chains, head**-0.5)])
    for reqs, pos in ((others[:2] + [tree] + others[2:], 2), ([tree], 0),
                      ([others[3], tree], 1)):
        kv = make_layer(torch.float32, "NHD", blocks_for(reqs, bs), bs, hkv, head)
        got = run(SDPA, kv, reqs, head**-0.5)[pos]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        if cpu_kernel.available():
            kv = make_layer(torch.float32, "NHD", blocks_for(reqs, bs), bs, hkv, head)
            paged = run(PAGED, kv, reqs, head**-0.5)[pos]
            torch.testing.assert_close(got, paged, rtol=1e-5, atol=1e-5)
    # the plain requests are untouched by the tree request's masks
    kv = make_layer(torch.float32, "NHD", blocks_for(others, bs), bs, hkv, head)
    plain = run(SDPA, kv, others, head**-0.5)
    kv = make_layer(torch.float32, "NHD", blocks_for(others, bs) + 64, bs, hkv, head)
    mixed = run(SDPA, kv, others[:2] + [tree] + others[2:], head**-0.5)
    for a, b in zip(plain, mixed[:2] + mixed[3:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _masked(masks: list[int], q_len: int | None = None) -> Step:
    q_len = q_len or len(masks)
    gen = torch.Generator().manual_seed(0)
    return Step(5, torch.randn(q_len, 2, 16, generator=gen), torch.randn(5 + q_len, 1, 16),
                torch.randn(5 + q_len, 1, 16), torch.tensor(masks, dtype=torch.long))


@pytest.mark.parametrize("backend", ["paged", "sdpa"])
@pytest.mark.parametrize("masks, message", [
    ([1, 0b11, 0b1001], "query row 2: mask 9 has its highest set bit at 3, must be the row's "
                        "own offset 2"),
    ([1, 0b1, 0b101], "query row 1: mask 1 has its highest set bit at 0"),
    ([1, 0b11, -1], "query row 2: mask -1 has its highest set bit at 63"),
])
def test_bad_masks_are_refused(backend, masks, message):
    if backend == "paged" and not cpu_kernel.available():
        pytest.skip("paged kernel unavailable")
    kv = make_layer(torch.float32, "NHD", 8, 4, 1, 16)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        run(PAGED if backend == "paged" else SDPA, kv, [_masked(masks)], 0.25)


@pytest.mark.parametrize("backend", ["paged", "sdpa"])
def test_masks_need_short_query_blocks(backend):
    if backend == "paged" and not cpu_kernel.available():
        pytest.skip("paged kernel unavailable")
    kv = make_layer(torch.float32, "NHD", 32, 4, 1, 16)
    masks = [0] * 64
    masks[5] = 0b100001
    with pytest.raises(ValueError, match="request 0 has q_len 64 > 63"):
        run(PAGED if backend == "paged" else SDPA, kv, [_masked(masks)], 0.25)
    masks[5] = 0  # all zero: plain causal rows, any length
    run(PAGED if backend == "paged" else SDPA, kv, [_masked(masks)], 0.25)


def test_batch_checks_its_masks():
    common = dict(q_lens=(2,), kv_lens=(4,), block_tables=((0,),),
                  slot_mapping=torch.tensor([2, 3]), block_size=4)
    with pytest.raises(ValueError, match="causal"):
        AttentionBatch(causal=False, tree_masks=torch.tensor([1, 3]), **common)
    with pytest.raises(ValueError, match="3 entries for 2 query tokens"):
        AttentionBatch(causal=True, tree_masks=torch.tensor([1, 3, 1]), **common)
    with pytest.raises(ValueError, match="int64"):
        AttentionBatch(causal=True, tree_masks=torch.tensor([1, 3], dtype=torch.int32), **common)
    assert AttentionBatch(causal=True, **common).tree_masks is None  # the default


@needs_kernel
def test_kernel_checks_its_masks():
    kv = make_layer(torch.float32, "NHD", 4, 4, 1, 8)
    args = (torch.randn(3, 1, 8), kv.logical, torch.tensor([[0, 1]]), torch.tensor([0, 3]),
            torch.tensor([5]))
    with pytest.raises(ValueError, match="need causal"):
        cpu_kernel.paged_attention(*args, False, 1.0, tree_masks=torch.tensor([1, 3, 5]))
    with pytest.raises(RuntimeError, match="one per query row"):
        cpu_kernel.paged_attention(*args, True, 1.0, tree_masks=torch.tensor([1, 3]))
    out = cpu_kernel.paged_attention(*args, True, 1.0, tree_masks=torch.tensor([1, 3, 5]))
    assert torch.isfinite(out).all()


def test_flashinfer_and_graphs_refuse_tree_steps():
    from attention.backends.flashinfer_backend import FlashInferBackend
    from engine.graphs import PaddedPasses

    batch = AttentionBatch(q_lens=(2,), kv_lens=(4,), block_tables=((0,),),
                           slot_mapping=torch.tensor([2, 3]), causal=True, block_size=4,
                           tree_masks=torch.tensor([1, 3]))
    backend = FlashInferBackend.__new__(FlashInferBackend)  # no flashinfer (nor CUDA) here
    with pytest.raises(NotImplementedError, match="tree masks are not supported by the "
                                                  "flashinfer backend"):
        backend.build_metadata(batch, CPU)
    passes = PaddedPasses.__new__(PaddedPasses)
    assert passes.fits(batch) is False
