"""Where a decode step's time goes: plain decoding against speculation with fixed K.

Each configuration (``--ks``: 0 is no speculation, K > 0 verifies K drafts of the DFlash
draft every step) runs in a process of its own, as a server runs one engine, on the same
prompts (``--concurrency`` at a time, greedy). The engine's own parts are timed where the
engine calls them (a wall-clock wrapper around each; nothing else changes): scheduling, the
target pass, the LM head, sampling, the draft's context K/V write (``_write_context``), its
block pass, its choice of tokens (draft head and argmax), the rest of ``propose``, the rest of
the runner's step, and the scheduler's update and the outputs. Each row is milliseconds per
engine step, averaged over every step after a warm-up prompt; ``ms per token`` divides the
whole step by the tokens it produced.

Measured on a 2-vCPU Xeon with AMX (twenty-fourth session, held-out chat, one stream): a plain
step took 21.9 ms, a step verifying 3 drafts 25.2 ms, of which the target pass grew by 0.9 ms
and the draft's context write, block pass and choice took 2.1 ms (its 18.5 MB of weights read
at the plain step's rate, 270 MB in 21.9 ms, would take 1.5 ms). Table in docs/performance.md.

    python benchmarks/bench_step_phases.py --ks 0 3 7 --prompts 4 --max-tokens 128

``--layers`` adds a second table: the target pass itself, by its number of query rows (a plain
step has one per request; a step verifying a tree of 32 drafts has 33 for its request), split
into the decoder layers' four products, attention (K/V write and kernel), the two norms, and
the rest (RoPE, SiLU, residual adds, Python). On the same machine kind (twenty-sixth session,
after that session's changes) a 33-row pass took 27.2 ms against 15.3 for one row: products
17.2 against 11.2, attention 4.0 against 1.0, the rest 4.6 against 2.5.

    python benchmarks/bench_step_phases.py --ks 0 7 --prompts 4 --max-tokens 128 --layers

``--ks -1`` runs the served default (the adaptive controller); ``--arrivals`` gives the engine
every prompt at once with room for ``--concurrency`` of them, so requests arrive as others
finish, as under that many clients of a server:

    python benchmarks/bench_step_phases.py --ks 0 -1 --prompts 24 --concurrency 8 --arrivals
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# (key, label): the order of the table's rows; "other" rows are derived in phases()
ROWS = (
    ("schedule", "scheduling"),
    ("target", "target pass"),
    ("head", "LM head"),
    ("sample", "sampling"),
    ("draft_context", "draft: context K/V"),
    ("draft_block", "draft: block pass"),
    ("draft_choose", "draft: choice (head, argmax)"),
    ("propose_other", "draft: rest of propose"),
    ("runner_other", "runner: rest"),
    ("update", "scheduler update"),
    ("outputs", "outputs"),
    ("step", "**whole step**"),
)


def instrument(llm) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the engine's parts with wall-clock timers; returns the running totals (seconds)
    and call counts, keyed as in ``ROWS`` (plus ``execute`` and ``propose``)."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    eng = llm.engine

    def wrap(obj: Any, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - t0
                calls[key] += 1

        setattr(obj, name, timed)

    wrap(eng, "step", "step")
    wrap(eng, "_outputs", "outputs")
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.scheduler, "update", "update")
    wrap(eng.runner, "execute", "execute")
    wrap(eng.runner, "run_target", "target")
    wrap(eng.runner.model, "compute_logits", "head")
    wrap(eng.runner, "sampler", "sample")
    if eng.proposer is not None:
        wrap(eng.proposer, "propose", "propose")
        wrap(eng.proposer, "_write_context", "draft_context")
        wrap(eng.proposer, "_block_pass", "draft_block")
        wrap(eng.proposer, "_rows_pass", "draft_block")  # a block's drafted slots alone
        # DFlash picks drafts in choose_rows (its choose reads a whole block through it); a
        # DFlash2 selector in choose
        wrap(eng.proposer, "choose_rows" if eng.proposer.trims_blocks else "choose",
             "draft_choose")
    return totals, calls


LAYER_PARTS = (
    ("qkv_proj", "QKV product"),
    ("o_proj", "O product"),
    ("gate_up", "gate/up product"),
    ("down", "down product"),
    ("attention", "attention (K/V write, kernel)"),
    ("norms", "norms (with residual add)"),
)


def instrument_layers(llm) -> tuple[dict[int, dict[str, float]], Callable[[], None]]:
    """Time the parts of the target's passes, keyed by the pass's query rows: totals (seconds)
    per part, plus ``passes`` and ``pass`` (the whole forward). Only the target's own calls
    count (the draft runs outside its forward). Also returns the function that takes the
    class-level attention timers off again (the module-level ones go with the model)."""
    model = llm.engine.runner.model
    by_rows: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    active: list[int] = []  # the rows of the target pass running now (empty: none)

    def timed(inner, key):
        def call(*args, **kwargs):
            if not active:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                by_rows[active[0]][key] += time.perf_counter() - t0
        return call

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for obj, name, key in ((attn.qkv_proj, "forward", "qkv_proj"),
                               (attn.o_proj, "forward", "o_proj"),
                               (mlp.gate_up_proj, "forward", "gate_up"),
                               (mlp.down_proj, "forward", "down"),
                               (layer.input_layernorm, "forward", "norms"),
                               (layer.post_attention_layernorm, "add", "norms")):
            setattr(obj, name, timed(getattr(obj, name), key))
    # attention: the metadata object of each step is new, so its class's method is wrapped
    from attention.backends import torch_backend

    classes = (torch_backend.PagedMetadata, torch_backend.TorchMetadata)
    untimed = [cls.attend for cls in classes]
    for cls in classes:
        cls.attend = timed(cls.attend, "attention")

    def restore() -> None:
        for cls, attend in zip(classes, untimed):
            cls.attend = attend
    forward = model.forward

    def whole(input_ids, *args, **kwargs):
        active.append(int(input_ids.shape[0]))
        t0 = time.perf_counter()
        try:
            return forward(input_ids, *args, **kwargs)
        finally:
            rows = active.pop()
            by_rows[rows]["pass"] += time.perf_counter() - t0
            by_rows[rows]["passes"] += 1

    model.forward = whole
    return by_rows, restore


def layer_table(results: list[dict], min_passes: int = 20) -> str:
    """ms per target pass by query rows (rows seen in at least ``min_passes`` passes: decode
    and verification shapes, not the odd prefill). A row count that several configurations
    ran is shown once, from the first of them that ran it that often."""
    heads = ["query rows", "passes", "target pass"] + [label for _, label in LAYER_PARTS] + ["rest"]
    lines = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    seen: dict[int, dict[str, float]] = {}
    for r in results:
        for rows, parts in r.get("layers", {}).items():
            if parts["passes"] >= min_passes and rows not in seen:
                seen[rows] = parts
    for rows in sorted(seen):
        parts = seen[rows]
        n = parts["passes"]
        cells = [1e3 * parts.get(key, 0.0) / n for key, _ in LAYER_PARTS]
        whole = 1e3 * parts["pass"] / n
        lines.append(f"| {rows} | {int(n)} | {whole:.2f} | "
                     + " | ".join(f"{c:.2f}" for c in cells) + f" | {whole - sum(cells):.2f} |")
    return "\n".join(lines)


def phases(totals: dict[str, float]) -> dict[str, float]:
    """The table's rows from the wrapped totals: the "rest" rows are what a wrapper measured
    beyond the parts inside it."""
    out = {key: totals.get(key, 0.0) for key, _ in ROWS}
    draft = sum(totals.get(k, 0.0) for k in ("draft_context", "draft_block", "draft_choose"))
    out["propose_other"] = max(0.0, totals.get("propose", 0.0) - draft)
    inside = sum(totals.get(k, 0.0) for k in ("target", "head", "sample", "propose"))
    out["runner_other"] = max(0.0, totals.get("execute", 0.0) - inside)
    return out


ADAPTIVE = -1  # ``--ks`` entry for the served default: the adaptive controller, the draft's tree


def run_config(k: int, common: dict, draft: str | None, prompts: list, max_tokens: int,
               concurrency: int, layers: bool = False, arrivals: bool = False) -> dict:
    """One configuration in this process: a warm-up prompt, then every prompt in batches of
    ``concurrency`` (with ``arrivals``: all at once into an engine that runs at most
    ``concurrency``, so a request starts whenever another finishes, prefills among decodes,
    as a server under that many clients sees them); totals per part, steps and tokens."""
    from engine import LLM, SamplingParams

    if k == ADAPTIVE:
        spec = {"method": "dflash", "model": draft}
    else:
        # a chain of K drafts: with the draft's tree, K would bound the depth of every node
        # verified (K = 3: 24 nodes of the shipped draft's tree, 25 query rows a step)
        spec = "none" if k == 0 else {"method": "dflash", "model": draft, "adaptive": False,
                                      "num_speculative_tokens": k, "tree": "chain"}
    if arrivals:
        common = {**common, "max_num_seqs": concurrency}
    llm = LLM(speculative_config=spec, **common)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(prompts[:1], params)  # first calls of each shape (kernels, allocations)
    totals, calls = instrument(llm)
    by_rows, restore = instrument_layers(llm) if layers else ({}, lambda: None)
    tokens = 0
    t0 = time.perf_counter()
    step = len(prompts) if arrivals else concurrency
    try:
        for i in range(0, len(prompts), step):
            outs = llm.generate(prompts[i:i + step], params)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        restore()
    wall = time.perf_counter() - t0
    return {"k": k, "phases": phases(totals), "steps": calls["step"], "tokens": tokens,
            "wall": wall, "layers": {rows: dict(parts) for rows, parts in by_rows.items()}}


def load_prompts(model: str, count: int) -> list:
    """The first ``count`` prompts of the held-out chat set, in the model's chat template."""
    from benchmarks import prompts as prompt_sets
    from benchmarks.bench_spec_policy import chat_questions
    from models.hf_folder import load_tokenizer
    from models.resolve import resolve_model_path

    return prompt_sets.chat(load_tokenizer(resolve_model_path(model)), chat_questions()[:count])


def table(results: list[dict]) -> str:
    heads = ["adaptive" if r["k"] == ADAPTIVE else f"K = {r['k']}" if r["k"]
             else "no speculation" for r in results]
    lines = ["| ms per step | " + " | ".join(heads) + " |", "|---" * (len(results) + 1) + "|"]
    for key, label in ROWS:
        cells = [f"{1e3 * r['phases'][key] / max(1, r['steps']):.2f}" for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    rows = {
        "tokens per step": [f"{r['tokens'] / max(1, r['steps']):.2f}" for r in results],
        "ms per token": [f"{1e3 * r['phases']['step'] / max(1, r['tokens']):.2f}" for r in results],
        "output tok/s": [f"{r['tokens'] / r['wall']:.1f}" for r in results],
        "steps": [str(r["steps"]) for r in results],
    }
    for label, cells in rows.items():
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", default=None, help="DFlash draft (default: the model's default)")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 3, 7],
                   help=f"0: no speculation; K: verify K drafts every step; {ADAPTIVE}: the "
                        "served default (adaptive controller)")
    p.add_argument("--arrivals", action="store_true",
                   help="submit every prompt at once to an engine running at most "
                        "--concurrency requests (requests arrive as others finish)")
    p.add_argument("--prompts", type=int, default=4, help="held-out chat prompts")
    p.add_argument("--prompt-ids", type=int, nargs="+", action="append", default=None,
                   help="token-id prompts instead of chat prompts (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", action="store_true",
                   help="also split the target pass into its layers' parts, by query rows")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (tests); by default each gets one")
    args = p.parse_args(argv)
    from benchmarks.bench_spec_policy import cpu_description
    from engine.args import default_draft_for

    draft = args.draft or default_draft_for(args.model)
    if any(args.ks) and draft is None:
        raise SystemExit(f"no default draft for {args.model}: give --draft")
    draft = str(draft) if draft else None
    common = {"model": args.model, "dtype": args.dtype}
    prompts = args.prompt_ids or load_prompts(args.model, args.prompts)
    jobs = [(k, common, draft, prompts, args.max_tokens, args.concurrency, args.layers,
             args.arrivals) for k in args.ks]
    if args.in_process:
        results = [run_config(*job) for job in jobs]
    else:
        ctx = mp.get_context("spawn")
        results = []
        for job in jobs:  # one engine at a time, each alone on the machine
            with ctx.Pool(1) as pool:
                results.append(pool.apply(run_config, job))
    print(f"# {cpu_description()}: {len(prompts)} prompts, {args.concurrency} at a time, at most "
          f"{args.max_tokens} tokens, greedy, {args.dtype}")
    print(table(results))
    if args.layers:
        print("\nms per target pass, by its query rows:")
        print(layer_table(results))
    return results


if __name__ == "__main__":
    main()
