"""Build the DFlash draft's training data: the target's own greedy answers, then tapped features.

Step 1 (``generate``): prompts from GSM8K train and self-instruct (minus the held-out slice
used for evaluation; never GSM8K test), plus the target's self-written user turns when
``scripts/self_synth.py`` has put them in the same folder (``selfgen_prompts.jsonl``, and
two-turn conversations in ``selfgen_turn2_prompts.jsonl``), are answered by the target itself
with this engine (greedy, chat template). Sequences go to ``sequences.jsonl`` (resumable: a
prompt already answered there, matched by source, text and earlier turns, is skipped, so
``--num-gsm8k`` can grow between runs). ``--interleave`` answers the sources round-robin, so a
run stopped early (``--deadline``) still holds a mix.

Step 2 (``features``): one prefill pass per sequence captures the outputs of the candidate
target layers, stored as float16 shards (``features-XXXX.pt``) so training epochs never rerun
the target. A shard is reused only if it holds exactly the sequences it should (so a shard
left partial by an earlier, shorter ``sequences.jsonl`` is rebuilt).

Optional step between them (``subset``): a folder holding the first ``--first`` sequences of
``--source``'s ``sequences.jsonl`` plus ``--random`` more drawn with ``--seed`` from the rest,
in data order, for when features of all of it would take too long.

    python scripts/dflash_data.py generate --out DIR --num-gsm8k 2400
    python scripts/dflash_data.py subset --source DIR --out SUB --first 500 --random 4000
    python scripts/dflash_data.py features --out DIR --layers 1 8 14 20 27
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attention.backends.base import AttentionBatch  # noqa: E402
from benchmarks import prompts as prompt_sets  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

# The last HELD_OUT user-oriented self-instruct tasks are kept out of training for evaluation.
HELD_OUT = 50


def default_out() -> Path:
    import os

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specserve" / "dflash-data"


# files written by scripts/self_synth.py into the data folder, read as extra prompt sources
SELFGEN_FILES = {"selfgen": "selfgen_prompts.jsonl", "selfgen_turn2": "selfgen_turn2_prompts.jsonl"}
SOURCES = ["gsm8k_train", "self_instruct", *SELFGEN_FILES]


def training_prompts(num_gsm8k: int, data_dir: Path = prompt_sets.DATA_DIR,
                     out: Path | None = None, gsm8k_from: int = 0) -> list[dict]:
    """Training prompts: ``num_gsm8k`` GSM8K train questions from index ``gsm8k_from`` (0: all
    the rest); with ``out``, also the self-generated ones found there (rows with ``history``:
    earlier turns, user first)."""
    questions = prompt_sets.gsm8k_questions("train", None, data_dir)[gsm8k_from:]
    rows = [{"source": "gsm8k_train", "prompt": q} for q in questions[:num_gsm8k or None]]
    seed = prompt_sets.read_jsonl(data_dir / "self_instruct_seed_tasks.jsonl")
    user = prompt_sets.read_jsonl(data_dir / "self_instruct_user_oriented.jsonl")
    for row in seed + user[:-HELD_OUT]:
        rows += [{"source": "self_instruct", "prompt": p} for p in prompt_sets._self_instruct_rows(row)]
    for source, name in SELFGEN_FILES.items():
        if out is not None and (out / name).exists():
            for r in prompt_sets.read_jsonl(out / name):
                row = {"source": source, "prompt": r["prompt"]}
                if r.get("history"):
                    row["history"] = r["history"]
                rows.append(row)
    return rows


def row_key(row: dict) -> tuple:
    return row["source"], row["prompt"], tuple(row.get("history") or ())


def messages(row: dict) -> list[dict]:
    turns = [*(row.get("history") or ()), row["prompt"]]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(turns)]


def interleave(rows: list[dict]) -> list[dict]:
    """Round-robin over sources, each source keeping its own order."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["source"], []).append(r)
    out, queues = [], [list(reversed(q)) for q in by.values()]
    while queues:
        for q in queues:
            out.append(q.pop())
        queues = [q for q in queues if q]
    return out


def held_out_prompts(data_dir: Path = prompt_sets.DATA_DIR) -> list[str]:
    user = prompt_sets.read_jsonl(data_dir / "self_instruct_user_oriented.jsonl")
    out: list[str] = []
    for row in user[-HELD_OUT:]:
        out += prompt_sets._self_instruct_rows(row)
    return out


def generate(args, llm: LLM | None = None) -> None:
    """Answer every training prompt with the target, keeping ``--batch`` requests in flight
    (continuous batching); each finished sequence is appended at once, so a run can stop and
    resume anywhere (``--deadline``: stop taking new prompts at that Unix time; answers still
    in flight are dropped and redone next run)."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sequences.jsonl"
    done: set[tuple] = set()
    if path.exists():
        done = {row_key(row) for row in map(json.loads, path.open())}
    rows = training_prompts(args.num_gsm8k, out=args.out, gsm8k_from=args.gsm8k_from)
    todo = [r for r in rows if row_key(r) not in done
            and (not args.sources or r["source"] in args.sources)]
    if args.interleave:
        todo = interleave(todo)
    print(f"{len(rows)} prompts, {len(done)} done, {len(todo)} to generate", flush=True)
    if llm is None:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, speculative_config=None,
                  max_model_len=args.max_model_len, max_num_seqs=args.batch)
    engine, tok = llm.engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    pending = list(reversed(todo))
    live: dict[str, tuple[dict, list[int]]] = {}
    start, tokens, finished = time.perf_counter(), 0, 0
    with path.open("a") as f:
        while pending or live:
            if args.deadline and time.time() > args.deadline:
                for rid in live:
                    engine.abort_request(rid)
                print(f"deadline: stopped with {len(live)} answers in flight", flush=True)
                break
            while pending and len(live) < args.batch:
                row = pending.pop()
                ids = tok.encode(tok.apply_chat_template(messages(row), tokenize=False,
                                                         add_generation_prompt=True))
                if len(ids) + args.max_tokens > args.max_model_len:
                    continue
                rid = engine.new_request_id()
                engine.add_request(rid, ids, params)
                live[rid] = (row, ids)
            for out in engine.step():
                if not out.finished:
                    continue
                row, ids = live.pop(out.request_id)
                resp = out.outputs[0].token_ids
                tokens += len(resp)
                finished += 1
                f.write(json.dumps({**row, "prompt_ids": ids, "response_ids": resp,
                                    "finish_reason": out.outputs[0].finish_reason}) + "\n")
                f.flush()
                if finished % 32 == 0:
                    rate = tokens / (time.perf_counter() - start)
                    print(f"{finished}/{len(todo)} answered ({len(done)} before), "
                          f"{rate:.0f} tok/s", flush=True)
    seconds = time.perf_counter() - start
    print(f"generated {finished} sequences, {tokens} response tokens in {seconds:.0f} s "
          f"({tokens / max(seconds, 1e-9):.1f} tok/s)", flush=True)


@torch.inference_mode()
def features(args) -> None:
    seqs = [json.loads(line) for line in (args.out / "sequences.jsonl").open()]
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, speculative_config=None,
              max_model_len=args.max_model_len, max_num_seqs=1)
    engine = llm.engine
    layers = tuple(args.layers)
    shard_size = args.shard_size
    meta_path = args.out / "features.json"
    old = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    # sequences per existing shard, when it was written with the same layers
    old_counts = dict(zip(old.get("shards", []), old.get("counts", []))) \
        if old.get("layers") == list(layers) else {}
    meta = {"layers": list(layers), "dtype": "float16", "shards": [], "counts": []}
    for s0 in range(0, len(seqs), shard_size):
        name = f"features-{s0 // shard_size:04d}.pt"
        chunk = seqs[s0 : s0 + shard_size]
        if old_counts.get(name) != len(chunk) or not (args.out / name).exists():
            feats, ids, lens, prompt_lens = [], [], [], []
            for row in chunk:
                seq = row["prompt_ids"] + row["response_ids"]
                feats.append(capture(engine, seq, layers).to(torch.float16))
                ids.append(torch.tensor(seq, dtype=torch.int32))
                lens.append(len(seq))
                prompt_lens.append(len(row["prompt_ids"]))
            torch.save({"features": torch.cat(feats), "ids": torch.cat(ids),
                        "lengths": torch.tensor(lens), "prompt_lengths": torch.tensor(prompt_lens),
                        "layers": list(layers)}, args.out / name)
            print(f"{name}: {len(chunk)} sequences, {sum(lens)} tokens", flush=True)
        meta["shards"].append(name)
        meta["counts"].append(len(chunk))
    meta_path.write_text(json.dumps(meta, indent=2))


def subset(args) -> None:
    """Write ``args.out/sequences.jsonl``: the first ``args.first`` lines of the source's, then
    ``args.random`` drawn from the rest with ``random.Random(args.seed)``, kept in data order."""
    import random

    lines = (args.source / "sequences.jsonl").read_text().splitlines()
    if args.first + args.random > len(lines):
        raise SystemExit(f"{args.source} holds {len(lines)} sequences, fewer than "
                         f"--first {args.first} + --random {args.random}")
    picked = sorted(random.Random(args.seed).sample(range(args.first, len(lines)), args.random))
    kept = lines[: args.first] + [lines[i] for i in picked]
    path = args.out / "sequences.jsonl"
    if path.exists():
        if path.read_text().splitlines() != kept:
            raise SystemExit(f"{path} exists and differs; remove it first")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in kept))
    print(f"{args.out}: {len(kept)} of {len(lines)} sequences", flush=True)


def capture(engine, token_ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """Outputs of ``layers`` for every position of one sequence (a single causal prefill).

    Borrows the first blocks of the engine's pool, so no request may be running."""
    if engine.has_unfinished_requests():
        raise RuntimeError("capture() borrows KV blocks; the engine must be idle")
    bs = engine.config.cache.block_size
    n = len(token_ids)
    nblk = -(-n // bs)
    batch = AttentionBatch(q_lens=(n,), kv_lens=(n,), block_tables=(tuple(range(nblk)),),
                           slot_mapping=torch.arange(n), causal=True, block_size=bs)
    meta = engine.runner.backend.build_metadata(batch, engine.device)
    _, captured = engine.model(torch.tensor(token_ids, device=engine.device),
                               torch.arange(n, device=engine.device), meta,
                               engine.runner.kv_layers, layers)
    return captured.float().cpu()


def main(argv: list[str] | None = None, llm: LLM | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["generate", "subset", "features"])
    p.add_argument("--out", type=Path, default=default_out())
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--num-gsm8k", type=int, default=2400)
    p.add_argument("--gsm8k-from", type=int, default=0,
                   help="index of the first GSM8K train question used (a later piece of data can "
                        "skip the questions an earlier draft trained on)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=None,
                   help="generate only prompts from these sources (default: all)")
    p.add_argument("--interleave", action="store_true",
                   help="answer the sources round-robin instead of one after another")
    p.add_argument("--deadline", type=float, default=None,
                   help="Unix time after which no new prompt is started")
    p.add_argument("--time-limit", type=float, default=None, help="seconds (sets --deadline)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 8, 14, 20, 27])
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--source", type=Path, default=None, help="subset: the full data folder")
    p.add_argument("--first", type=int, default=0, help="subset: keep the first N sequences")
    p.add_argument("--random", type=int, default=0, help="subset: and N more drawn at random")
    p.add_argument("--seed", type=int, default=0, help="subset: the draw's seed")
    args = p.parse_args(argv)
    if args.step == "subset":
        if args.source is None:
            p.error("subset needs --source")
        return subset(args)
    if args.time_limit and not args.deadline:
        args.deadline = time.time() + args.time_limit
    torch.manual_seed(0)
    generate(args, llm) if args.step == "generate" else features(args)


if __name__ == "__main__":
    main()
