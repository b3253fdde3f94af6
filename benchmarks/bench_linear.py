"""The matrix products of a decode step five ways: ``F.linear``, PyTorch's oneDNN-packed
weights (``mkldnn._linear_pointwise``, one row padded to ``--pad`` rows as ``layers.linear``
must for row-count invariance), the direct oneDNN path (``models/onednn.py``, one row as is)
and, for bf16, the compiled AVX2 panel kernel and the AVX512_BF16 pair kernel
(``models/panel_linear.py``, one row as is).

SmolLM2-135M-Instruct's shapes by default (QKV 576->960, O 576->576, gate/up 576->3072, down
1536->576 per layer, LM head 576->49152), random weights, a distinct weight per layer as in a
real step (so they come from memory). Each round times one step's products (30 layers x 4
projections + the LM head) once per way, in turn; the table gives the median over the rounds,
the direct / PyTorch-packed ratio, and whether the direct and panel rows have the same bits at
this row count as inside a 64-row product.

    python benchmarks/bench_linear.py --dtypes bfloat16 float32 --rows 1 4 16 32 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import onednn, panel_linear  # noqa: E402
from models.layers import linear  # noqa: E402

PROJECTIONS = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out), once per layer
HEAD = (576, 49152)
WAYS = ("plain", "packed", "direct", "panels", "pairs")
INVARIANT = ("direct", "panels", "pairs")  # the ways whose rows must not depend on the row count


def step_weights(dtype: torch.dtype, layers: int, seed: int = 0) -> list[torch.Tensor]:
    """A step's weights ``[out, in]`` in the order it multiplies them."""
    g = torch.Generator().manual_seed(seed)
    shapes = [s for _ in range(layers) for s in PROJECTIONS] + [HEAD]
    return [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for k, n in shapes]


def compare(dtype: torch.dtype, rows: int, layers: int, rounds: int, pad: int = 2
            ) -> dict[str, float | bool | None]:
    """Median ms per step for each way (``None`` where it is unavailable here) and, for the
    direct and panel ways, ``same_bits_<way>``: its rows equal the same rows inside a 64-row
    product (``None`` where the way is unavailable)."""
    weights = step_weights(dtype, layers)
    g = torch.Generator().manual_seed(1)
    inputs = {k: torch.randn(64, k, generator=g).to(dtype) for k in {w.shape[1] for w in weights}}
    try:
        torch_packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    except RuntimeError:
        torch_packed = None
    invariant = {way: [pack(w) for w in weights]
                 for way, pack in (("direct", onednn.pack), ("panels", panel_linear.pack),
                                   ("pairs", panel_linear.pack_pairs))}
    invariant = {way: ps for way, ps in invariant.items() if all(p is not None for p in ps)}

    runs = {"plain": lambda: [F.linear(inputs[w.shape[1]][:rows], w) for w in weights]}
    if torch_packed is not None:
        runs["packed"] = lambda: [linear(inputs[p.shape[1]][:rows], None, packed=p, min_rows=pad)
                                  for p in torch_packed]
    for way, products in invariant.items():
        runs[way] = lambda products=products: [p(inputs[p.shape[1]][:rows]) for p in products]
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():
            run()  # warm-up: kernels are built for this row count
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
        same = {f"same_bits_{way}": all(
            torch.equal(p(inputs[p.shape[1]][:rows]), p(inputs[p.shape[1]])[:rows])
            for p in products) for way, products in invariant.items()}
    res: dict[str, float | bool | None] = {w: None for w in WAYS}
    res.update({f"same_bits_{way}": None for way in INVARIANT})
    res.update({name: statistics.median(t) for name, t in times.items()})
    res.update(same)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--pad", type=int, default=2, help="rows one row is padded to (packed way)")
    args = p.parse_args()
    direct = onednn.load()
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, direct oneDNN "
          f"{direct.version() if direct else 'unavailable: ' + str(onednn.error())}")
    print("| dtype | rows | F.linear ms/step | packed ms/step | direct ms/step | panels ms/step "
          "| pairs ms/step | best invariant / packed | invariant rows as in 64 |")
    print("|---|---|---|---|---|---|---|---|---|")

    def fmt(v):
        return "-" if v is None else f"{v:.1f}"

    for name in args.dtypes:
        for rows in args.rows:
            r = compare(getattr(torch, name), rows, args.layers, args.rounds, args.pad)
            best = min((r[w] for w in INVARIANT if r[w] is not None), default=None)
            ratio = f"{best / r['packed']:.2f}" if best and r["packed"] else "-"
            same = ", ".join(f"{w} {'yes' if r[f'same_bits_{w}'] else 'no'}"
                             for w in INVARIANT if r[f"same_bits_{w}"] is not None) or "-"
            print(f"| {name} | {rows} | {fmt(r['plain'])} | {fmt(r['packed'])} | "
                  f"{fmt(r['direct'])} | {fmt(r['panels'])} | {fmt(r['pairs'])} | {ratio} | "
                  f"{same} |")

if __name__ == "__main__":
    main()
