"""Evaluate DFlash / DFlash2 drafts: acceptance and wall-clock speed with and without
speculation. Several ``--draft`` folders are measured side by side on the same sets.

On fixed sets never used in training, greedy: mean acceptance length, acceptance per
position, and output tokens/s for a single stream and for C concurrent requests, with and
without the draft, in one run. Sets (``--sets``): ``gsm8k-test`` (first N GSM8K test
questions), ``self-instruct-heldout`` (the last 50 user-oriented self-instruct tasks),
``selfgen-heldout`` (200 self-generated chat prompts, ``benchmarks/data/selfgen_heldout.jsonl``,
see ``scripts/self_synth.py``), ``code`` (short programming requests,
``benchmarks/data/code_heldout.jsonl``); ``--limit N`` caps every set at N prompts.

    python benchmarks/eval_acceptance.py --draft models/drafts/smollm2-135m-instruct-dflash
    python benchmarks/eval_acceptance.py --sets selfgen-heldout code --skip-speed

The speculative engine verifies all K drafts every step (``"adaptive": false``), or every node
of the tree of drafts a draft ships (``tree.json``, ``engine/spec/tree.py``; ``--chain``
verifies chains of K instead), so the figures describe the draft itself;
``benchmarks/bench_spec_policy.py`` measures the adaptive default against fixed K and no
speculation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from benchmarks import prompts as prompt_sets  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.args import default_draft_for  # noqa: E402


DATA = Path(__file__).resolve().parent / "data"
SETS = ["gsm8k-test", "self-instruct-heldout", "selfgen-heldout", "code"]


def held_out() -> list[str]:
    from dflash_data import held_out_prompts

    return held_out_prompts()


def jsonl_prompts(name: str) -> list[str]:
    return [r["prompt"] for r in prompt_sets.read_jsonl(DATA / name)]


def run(llm: LLM, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    s0 = llm.get_spec_decoding_stats()
    before = (s0.num_drafts, s0.num_accepted_tokens, list(s0.num_accepted_tokens_per_pos))
    tokens, start = 0, time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), concurrency):
        outs = llm.generate(prompts[i : i + concurrency], params)
        outputs += [o.outputs[0].token_ids for o in outs]
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    s1 = llm.get_spec_decoding_stats()
    drafts = s1.num_drafts - before[0]
    accepted = s1.num_accepted_tokens - before[1]
    per_pos = [(a - b) / drafts if drafts else 0.0
               for a, b in zip(s1.num_accepted_tokens_per_pos, before[2])]
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "drafts": drafts,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "accepted_per_pos": [round(p, 3) for p in per_pos], "outputs": outputs}


def draft_label(kind: str, draft: Path, drafts: list[Path]) -> str:
    """``kind:name``, or ``kind:parent/name`` when another draft has the same folder name (runs
    keep their best draft in ``RUN/draft``), so no draft's results replace another's."""
    if sum(d.name == draft.name for d in drafts) > 1:
        return f"{kind}:{draft.parent.name}/{draft.name}"
    return f"{kind}:{draft.name}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", nargs="+", default=["default"],
                   help="one or more draft folders (DFlash or DFlash2, detected), each measured "
                        "on the same sets against the same no-spec baseline")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--chain", action="store_true",
                   help="verify chains of K drafts even where a draft ships a tree.json")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gsm8k", type=int, default=200, help="first N GSM8K test questions")
    p.add_argument("--speed-prompts", type=int, default=16,
                   help="prompts per set used for the timed runs")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--sets", nargs="+", default=SETS, choices=SETS)
    p.add_argument("--limit", type=int, default=None,
                   help="at most N prompts of every set (after --gsm8k)")
    p.add_argument("--skip-acceptance", action="store_true",
                   help="only the timed runs (no pass over the whole set)")
    p.add_argument("--skip-speed", action="store_true",
                   help="only the acceptance pass over each set (no timed runs, no plain engine)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    drafts = [default_draft_for(args.model) if d == "default" else Path(d) for d in args.draft]
    if None in drafts:
        raise SystemExit("No shipped draft for this model; pass --draft PATH")
    if len({str(d.resolve()) for d in drafts}) < len(drafts):
        raise SystemExit("a --draft folder is given twice")
    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048,
                  max_num_seqs=max(args.concurrency, 8))
    engines = {}
    for draft in drafts:
        # the draft's own acceptance: every step verifies all K drafts (the adaptive default
        # verifies fewer where they do not pay; benchmarks/bench_spec_policy.py compares the two)
        spec = {"method": "dflash", "model": str(draft), "adaptive": False}
        if args.chain:
            spec["tree"] = "chain"
        if args.num_speculative_tokens:
            spec["num_speculative_tokens"] = args.num_speculative_tokens
        llm = LLM(speculative_config=spec, **common)
        kind = "dflash2" if type(llm.engine.proposer).__name__ == "DFlash2Proposer" else "dflash"
        engines[draft_label(kind, draft, drafts)] = (draft, llm)
    if args.skip_speed and args.skip_acceptance:
        raise SystemExit("--skip-speed and --skip-acceptance leave nothing to measure")
    plain = None if args.skip_speed else LLM(speculative_config=None, **common)
    tok = next(iter(engines.values()))[1].get_tokenizer()
    # the first requests of an engine are several times slower (kernels built and loaded,
    # first-use allocations): keep them out of the timed runs
    for _, llm in list(engines.values()) + ([(None, plain)] if plain else []):
        llm.generate(prompt_sets.chat(tok, ["Say hello."]) * 2,
                     SamplingParams(max_tokens=16, temperature=0))
    loaders = {
        "gsm8k-test": lambda: prompt_sets.gsm8k_questions("test", args.gsm8k),
        "self-instruct-heldout": held_out,
        "selfgen-heldout": lambda: jsonl_prompts("selfgen_heldout.jsonl"),
        "code": lambda: jsonl_prompts("code_heldout.jsonl"),
    }
    sets = {name: prompt_sets.chat(tok, loaders[name]()[: args.limit]) for name in args.sets}
    report = {"drafts": {}, "adaptive": False, "no_spec": {}}
    c = f"c{args.concurrency}_tok_s"
    for name, prompts in sets.items():
        subset = prompts[: args.speed_prompts]
        single_prompts = subset[: max(2, args.speed_prompts // 4)]
        if plain is not None:
            base_single = run(plain, single_prompts, 1, args.max_tokens)
            base_batch = run(plain, subset, args.concurrency, args.max_tokens)
            report["no_spec"][name] = {
                "single_tok_s": round(base_single["tok_s"], 1), c: round(base_batch["tok_s"], 1),
                "single_ms_per_step": round(1000 * base_single["seconds"] / base_single["tokens"], 2)}
        for label, (draft, llm) in engines.items():
            entry = report["drafts"].setdefault(label, {
                "draft": str(draft),
                "num_speculative_tokens": llm.engine.proposer.num_speculative_tokens, "sets": {}})
            result = {"prompts": len(prompts)}
            if plain is not None:
                single = run(llm, single_prompts, 1, args.max_tokens)
                batch = run(llm, subset, args.concurrency, args.max_tokens)
                steps = single["drafts"] + len(single_prompts)  # single stream: one step per draft
            # acceptance over the whole set, or what the timed single stream accepted
            acc = single if args.skip_acceptance else run(llm, prompts, 16, args.max_tokens)
            result["acceptance_length"] = round(acc["acceptance_length"] or 1.0, 3)
            result["accepted_per_pos"] = acc["accepted_per_pos"]
            if plain is not None:
                result["speed"] = {"single_tok_s": round(single["tok_s"], 1),
                                   c: round(batch["tok_s"], 1),
                                   "single_ms_per_step": round(1000 * single["seconds"] / steps, 2)}
                result["single_speedup"] = round(single["tok_s"] / base_single["tok_s"], 2)
            entry["sets"][name] = result
            print(label, name, json.dumps(result), flush=True)
    print()
    print("| draft | set | prompts | mean acceptance length | accepted per position "
          f"| single tok/s (draft / none) | ms per step single (draft / none) "
          f"| c={args.concurrency} tok/s (draft / none) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, entry in report["drafts"].items():
        for name, r in entry["sets"].items():
            s, b = r.get("speed"), report["no_spec"].get(name)
            speed = (f"{s['single_tok_s']} / {b['single_tok_s']} | "
                     f"{s['single_ms_per_step']} / {b['single_ms_per_step']} | {s[c]} / {b[c]}"
                     if s else "- | - | -")
            print(f"| {label} | {name} | {r['prompts']} | {r['acceptance_length']:.2f} | "
                  f"{' '.join(f'{x:.2f}' for x in r['accepted_per_pos'])} | {speed} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
