"""Offline speed: this engine (with and without speculation) next to transformers ``generate``.

Same machine, same prompts, same dtype, one run. Prints a Markdown table of output tokens per
second at each concurrency (1 = prompts one at a time; N = N prompts submitted together).

    python benchmarks/bench_offline.py --dtype bfloat16 --max-tokens 128 --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import prompts as prompt_sets  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.args import default_draft_for  # noqa: E402

SYSTEMS = ("specserve", "specserve-ngram", "specserve-dflash", "transformers")


@dataclass
class Row:
    system: str
    concurrency: int
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_specserve(args, name: str, spec, questions: list[str]) -> list[Row]:
    llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec,
              max_model_len=args.max_model_len, max_num_seqs=max(args.concurrency))
    prompts = prompt_sets.chat(llm.get_tokenizer(), questions)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=args.ignore_eos)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    rows = []
    for c in args.concurrency:
        before = _stats_tuple(llm)
        start = time.perf_counter()
        tokens = 0
        groups = [prompts[i : i + 1] for i in range(args.single_prompts)] if c == 1 else [prompts[:c]]
        for group in groups:
            for out in llm.generate(group, params):
                tokens += len(out.outputs[0].token_ids)
        seconds = time.perf_counter() - start
        extra = {}
        if spec is not None:
            after = llm.get_spec_decoding_stats()
            drafts = after.num_drafts - before[0]
            accepted = after.num_accepted_tokens - before[1]
            per_pos = [a - b for a, b in zip(after.num_accepted_tokens_per_pos, before[2])]
            extra = {
                "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                "accepted_per_pos": [round(p / drafts, 3) if drafts else 0.0 for p in per_pos],
            }
        rows.append(Row(name, c, tokens, seconds, extra))
        print(f"  {name:18s} c={c:<3d} {tokens / seconds:8.1f} tok/s {extra}", flush=True)
    del llm
    gc.collect()
    return rows


def _stats_tuple(llm: LLM) -> tuple[int, int, list[int]]:
    s = llm.get_spec_decoding_stats()
    return s.num_drafts, s.num_accepted_tokens, list(s.num_accepted_tokens_per_pos)


def run_transformers(args, questions: list[str]) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from engine.config import parse_dtype
    from engine.dtype_choice import auto_dtype
    from models.hf_folder import load_hf_config, load_tokenizer
    from models.resolve import resolve_model_path

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    dtype = parse_dtype(args.dtype) or auto_dtype(load_hf_config(path), torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    prompts = prompt_sets.chat(tok, questions)
    eos = tok.eos_token_id
    rows = []

    def generate(batch: list[str]) -> int:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs = dict(max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=eos)
        if args.ignore_eos:
            kwargs.update(min_new_tokens=args.max_tokens)
        with torch.inference_mode():
            out = model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        count = 0
        for row in new.tolist():
            count += next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
        return count

    generate(prompts[:1])
    for c in args.concurrency:
        start = time.perf_counter()
        batches = [prompts[i : i + 1] for i in range(args.single_prompts)] if c == 1 else [prompts[:c]]
        tokens = sum(generate(b) for b in batches)
        seconds = time.perf_counter() - start
        rows.append(Row("transformers", c, tokens, seconds))
        print(f"  {'transformers':18s} c={c:<3d} {tokens / seconds:8.1f} tok/s", flush=True)
    return rows


def random_draft_folder(model: str) -> Path:
    from models.dflash_init import draft_hf_config, random_draft, save_draft
    from models.hf_folder import load_hf_config
    from models.loader import decoder_config
    from models.resolve import resolve_model_path

    target = decoder_config(load_hf_config(resolve_model_path(model)))
    cfg = draft_hf_config(target, num_layers=1, block_size=8, mask_token_id=0)
    folder = Path(tempfile.mkdtemp(prefix="random-dflash-"))
    save_draft(random_draft(cfg), cfg, folder)
    return folder


def markdown(rows: list[Row], concurrency: list[int]) -> str:
    systems = list(dict.fromkeys(r.system for r in rows))
    head = "| system | " + " | ".join(f"c={c} tok/s" for c in concurrency) + " | acceptance length |"
    lines = [head, "|" + "---|" * (len(concurrency) + 2)]
    for s in systems:
        cells = []
        acc = []
        for c in concurrency:
            r = next((r for r in rows if r.system == s and r.concurrency == c), None)
            cells.append(f"{r.tok_s:.1f}" if r else "-")
            if r and "acceptance_length" in r.extra:
                acc.append(f"{r.extra['acceptance_length']:.2f}")
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {' / '.join(acc) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--single-prompts", type=int, default=4, help="prompts run one at a time for c=1")
    p.add_argument("--prompts", default="gsm8k", help="gsm8k, self-instruct, chat or a .jsonl file")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--draft", default="default",
                   help="DFlash draft folder; 'default' = the shipped draft, 'random' = random weights")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    torch.manual_seed(0)

    questions = prompt_sets.load(args.prompts, max(max(args.concurrency), args.single_prompts))
    rows: list[Row] = []
    print(f"dtype={args.dtype} max_tokens={args.max_tokens} prompts={args.prompts} "
          f"ignore_eos={args.ignore_eos} threads={torch.get_num_threads()}", flush=True)
    for system in args.systems:
        if system == "specserve":
            rows += run_specserve(args, system, None, questions)
        elif system == "specserve-ngram":
            spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens or 5}
            rows += run_specserve(args, system, spec, questions)
        elif system == "specserve-dflash":
            if args.draft == "default":
                draft = default_draft_for(args.model)
            else:
                draft = None if args.draft == "random" else Path(args.draft)
            label = "specserve-dflash"
            if draft is None:
                draft, label = random_draft_folder(args.model), "specserve-dflash(random)"
            spec = {"method": "dflash", "model": str(draft)}
            if args.num_speculative_tokens:
                spec["num_speculative_tokens"] = args.num_speculative_tokens
            rows += run_specserve(args, label, spec, questions)
        else:
            rows += run_transformers(args, questions)
    print()
    print(markdown(rows, args.concurrency))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ | {"tok_s": r.tok_s} for r in rows], indent=2))


if __name__ == "__main__":
    main()
