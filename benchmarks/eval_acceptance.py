"""Evaluate a DFlash draft: acceptance and wall-clock speed with and without speculation.

On the first N GSM8K test questions and on the held-out self-instruct slice (never used in
training), greedy: mean acceptance length, acceptance per position, and output tokens/s for a
single stream and for C concurrent requests, with and without the draft, in one run.

    python benchmarks/eval_acceptance.py --draft models/drafts/smollm2-135m-instruct-dflash

``--min-acceptance-length X`` adds the opt-in acceptance gate (see ``engine/spec/gate.py``) to
the speculative engine; acceptance lengths are then measured over the drafts the gate let
through, so report them from a run without it.
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


def held_out() -> list[str]:
    from dflash_data import held_out_prompts

    return held_out_prompts()


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
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "accepted_per_pos": [round(p, 3) for p in per_pos], "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="default")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gsm8k", type=int, default=200, help="first N GSM8K test questions")
    p.add_argument("--speed-prompts", type=int, default=16,
                   help="prompts per set used for the timed runs")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-acceptance-length", type=float, default=None)
    p.add_argument("--sets", nargs="+", default=["gsm8k-test", "self-instruct-heldout"],
                   choices=["gsm8k-test", "self-instruct-heldout"])
    p.add_argument("--skip-acceptance", action="store_true",
                   help="only the timed runs (no pass over the whole set)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    draft = default_draft_for(args.model) if args.draft == "default" else Path(args.draft)
    if draft is None:
        raise SystemExit("No shipped draft for this model; pass --draft PATH")
    spec = {"method": "dflash", "model": str(draft)}
    if args.num_speculative_tokens:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.min_acceptance_length:
        spec["min_acceptance_length"] = args.min_acceptance_length
    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048,
                  max_num_seqs=max(args.concurrency, 8))
    with_spec = LLM(speculative_config=spec, **common)
    plain = LLM(speculative_config=None, **common)
    tok = with_spec.get_tokenizer()
    loaders = {
        "gsm8k-test": lambda: prompt_sets.gsm8k_questions("test", args.gsm8k),
        "self-instruct-heldout": held_out,
    }
    sets = {name: prompt_sets.chat(tok, loaders[name]()) for name in args.sets}
    report = {"draft": str(draft), "num_speculative_tokens": with_spec.engine.proposer.num_speculative_tokens,
              "min_acceptance_length": args.min_acceptance_length, "sets": {}}
    for name, prompts in sets.items():
        speed = {}
        subset = prompts[: args.speed_prompts]
        for label, llm in (("dflash", with_spec), ("no-spec", plain)):
            single = run(llm, subset[: max(2, args.speed_prompts // 4)], 1, args.max_tokens)
            batch = run(llm, subset, args.concurrency, args.max_tokens)
            if label == "dflash":
                timed_single = single
            speed[label] = {"single_tok_s": round(single["tok_s"], 1),
                            f"c{args.concurrency}_tok_s": round(batch["tok_s"], 1)}
        # acceptance over the whole set, or what the timed single stream accepted
        acc = timed_single if args.skip_acceptance else run(with_spec, prompts, 16, args.max_tokens)
        report["sets"][name] = {
            "prompts": len(prompts),
            "acceptance_length": round(acc["acceptance_length"] or 1.0, 3),
            "accepted_per_pos": acc["accepted_per_pos"],
            "speed": speed,
            "single_speedup": round(speed["dflash"]["single_tok_s"] / speed["no-spec"]["single_tok_s"], 2),
        }
        print(name, json.dumps(report["sets"][name]), flush=True)
    print()
    print("| set | prompts | mean acceptance length | accepted per position | single tok/s (dflash / none) "
          f"| c={args.concurrency} tok/s (dflash / none) |")
    print("|---|---|---|---|---|---|")
    for name, r in report["sets"].items():
        s = r["speed"]
        c = f"c{args.concurrency}_tok_s"
        print(f"| {name} | {r['prompts']} | {r['acceptance_length']:.2f} | "
              f"{' '.join(f'{x:.2f}' for x in r['accepted_per_pos'])} | "
              f"{s['dflash']['single_tok_s']} / {s['no-spec']['single_tok_s']} | "
              f"{s['dflash'][c]} / {s['no-spec'][c]} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
