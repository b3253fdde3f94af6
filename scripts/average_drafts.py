"""Average two saved drafts of the same shape: ``OUT = w * A + (1 - w) * B``, weight by weight.

A continued run learns its new data and forgets some of what the draft it started from knew;
the average of the two keeps more of both (stage 6 of the default draft: better than the draft
it started from on all four held-out sets, and than the continued run on two, level on the
other two; see its model card). Floating-point tensors
(``model.safetensors`` and ``mask_embedding.safetensors``) are averaged in float32 and stored in
A's dtype; integer tensors (the reduced vocabulary's ``d2t``) must be equal, as must
``config.json``, which is copied from A.

    python scripts/average_drafts.py A B --weight 0.5 --out OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FILES = ("model.safetensors", "mask_embedding.safetensors")


def average(a: Path, b: Path, weight: float, out: Path) -> None:
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"--weight must be in [0, 1], got {weight}")
    if json.loads((a / "config.json").read_text()) != json.loads((b / "config.json").read_text()):
        raise ValueError(f"{a} and {b} have different config.json: not the same draft shape")
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if not (a / name).exists():
            continue
        ta, tb = load_file(a / name), load_file(b / name)
        if ta.keys() != tb.keys():
            raise ValueError(f"{name}: different tensors in {a} and {b}")
        res = {}
        for key, x in ta.items():
            y = tb[key]
            if x.shape != y.shape:
                raise ValueError(f"{name}:{key}: shapes {tuple(x.shape)} and {tuple(y.shape)}")
            if x.is_floating_point():
                res[key] = (weight * x.float() + (1 - weight) * y.float()).to(x.dtype)
            elif torch.equal(x, y):
                res[key] = x
            else:
                raise ValueError(f"{name}:{key}: integer tensors differ (another draft vocabulary?)")
        save_file(res, out / name)
    shutil.copy(a / "config.json", out / "config.json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--weight", type=float, default=0.5, help="weight of A")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    average(args.a, args.b, args.weight, args.out)
    print(f"{args.out}: {args.weight} x {args.a} + {1 - args.weight:g} x {args.b}")


if __name__ == "__main__":
    main()
