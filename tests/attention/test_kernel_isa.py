"""The CPU kernels built for AVX2 (``SPECSERVE_KERNEL_MARCH=x86-64-v3``, what a CPU without
AVX-512 builds) compute the same bits as this machine's own build.

Without AVX-512 the kernels' 16-float vectors are pairs of 8-float halves (``cpu_common.h``);
every lane must still see the same IEEE operations in the same order, so the two builds agree
bitwise on every path whose arithmetic does not depend on the instruction set. The one that
does: bfloat16 pages with a bfloat16 query and head size 64/128 use bfloat16 dot products where
the CPU has AVX512-BF16, so those cases are left out. The AVX2 build runs in a subprocess with
its own build folder (one to two minutes to compile on two cores). On a CPU without AVX-512 the
native build already is an AVX2 build (every other test runs it), so the second one is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


pytestmark = [
    pytest.mark.skipif(not cpu_kernel.available(), reason="CPU kernels not built here"),
    pytest.mark.skipif("avx2" not in _cpu_flags(), reason="this CPU cannot run an AVX2 build"),
    pytest.mark.skipif("avx512f" not in _cpu_flags(),
                       reason="no AVX-512 here: the native build is the AVX2 build"),
]

ATTENTION_CASES = [  # (head size, q heads, kv heads, cache dtype, query dtype)
    (d, hq, hkv, kv, q)
    for d, hq, hkv in ((64, 9, 3), (128, 8, 2), (80, 4, 4))
    for kv in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    for q in (torch.float32, torch.bfloat16)
    if not (kv == torch.bfloat16 and q == torch.bfloat16 and d in (64, 128))
]


# per query row of the attention cases (q_lens 1, 1, 8, 1, 8): 0 (causal) or a tree mask
_TREE8 = [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b100011, 0b1001011, 0b10010101]
TREE_MASKS = torch.tensor([0, 0, *_TREE8, 0, *_TREE8], dtype=torch.long)


def kernel_outputs(mod) -> dict[str, torch.Tensor]:
    """Every kernel on fixed random inputs: decode and verify rows over contexts of 1..301
    positions in shuffled 16-token pages, then the layer ops on bfloat16 and float32 rows."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([1, 17, 40, 130, 301])
    q_lens = torch.tensor([1, 1, 8, 1, 8])
    q_indptr = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    bs, per = 16, 19
    for d, hq, hkv, kv, q in ATTENTION_CASES:
        cache = torch.randn(5 * per + 1, 2, bs, hkv, d, generator=gen).to(kv)
        tables = torch.randperm(5 * per, generator=gen).view(5, per).contiguous()
        query = torch.randn(int(q_indptr[-1]), hq, d, generator=gen).to(q)
        scales = (1.0, 1.0) if kv != torch.float8_e4m3fn else (0.5, 2.0)
        for causal in (True, False):
            out[f"attn-{d}-{hq}-{hkv}-{kv}-{q}-{causal}"] = mod.paged_attention(
                query, cache, tables, q_indptr, lens, causal, d ** -0.5, *scales, 4)
        # the verify blocks as draft trees (tree masks; node parents -, 0, 0, 1, 2, 1, 3, 4)
        out[f"attn-tree-{d}-{hq}-{hkv}-{kv}-{q}"] = mod.paged_attention(
            query, cache, tables, q_indptr, lens, True, d ** -0.5, *scales, 4, TREE_MASKS)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(7, 576, generator=gen).to(dtype)
        res = torch.randn(7, 576, generator=gen).to(dtype)
        w = torch.randn(576, generator=gen).to(dtype)
        out[f"rms-{dtype}"] = mod.rms_norm(x, w, 1e-5)
        out[f"add-rms-{dtype}"] = torch.cat(mod.add_rms_norm(x, res, w, 1e-5))
        out[f"silu-{dtype}"] = mod.silu_mul(torch.randn(7, 2 * 1536, generator=gen).to(dtype))
        qkv = torch.randn(7, 15, 64, generator=gen).to(dtype)
        angle = torch.rand(7, 32, generator=gen) * 6
        cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
        sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
        out[f"rope-{dtype}"] = torch.cat([t.flatten() for t in mod.rope_qk(qkv, cos, sin, 9, 3)])
    return out


_CHILD = """
import sys, torch
from attention import cpu_kernel
from tests.attention.test_kernel_isa import kernel_outputs
mod = cpu_kernel.load()
assert mod is not None, cpu_kernel.error()
torch.save(kernel_outputs(mod), sys.argv[1])
"""


def test_avx2_build_computes_the_same_bits_as_the_native_build(tmp_path):
    env = dict(os.environ, SPECSERVE_KERNEL_MARCH="x86-64-v3",
               SPECSERVE_KERNEL_BUILD_DIR=str(tmp_path / "build-avx2"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = tmp_path / "avx2.pt"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(result)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    avx2 = torch.load(result)
    native = kernel_outputs(cpu_kernel.load())
    assert avx2.keys() == native.keys()
    differing = [name for name in native
                 if not torch.equal(native[name].view(torch.uint8), avx2[name].view(torch.uint8))]
    assert not differing, differing
