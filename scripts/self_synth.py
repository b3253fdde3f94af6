"""Self-synthesised user turns for the DFlash draft's training data (no network needed).

The target writes the *user* side of a chat itself: it is given the bare chat template up to
and including ``<|im_start|>user\\n`` and samples (temperature, one seed per sample) until it
closes the turn with ``<|im_end|>``. Its own greedy answers to the kept turns are then produced
by ``dflash_data.py generate`` like every other training prompt (source ``selfgen``). A second
user turn is written the same way after a first answer (template of [user, assistant] then
``<|im_start|>user\\n``), giving two-turn conversations (source ``selfgen_turn2``).

Every sample goes through the engine's offline batched path (``LLM.generate``, many prompts
per call so continuous batching keeps ``--batch`` requests in flight). Raw samples are appended
to ``selfgen_raw.jsonl`` / ``selfgen_turn2_raw.jsonl`` as they finish, keyed by sample index;
sample i always uses seed ``seed * 10**7 + i``, so a rerun skips the indices already there and
continues where it stopped, with the same result as one uninterrupted run. Selection (filters,
then deduplication, in index order) is recomputed from the raw files on every run and written
to ``selfgen_prompts.jsonl`` / ``selfgen_turn2_prompts.jsonl`` plus ``selfgen_stats.json``.

Filters (first failing one is the reason a sample is dropped): ``truncated`` (no ``<|im_end|>``
within ``--max-user-tokens``), ``special_token`` (a template token inside the turn),
``too_short`` (< 3 words or < 12 characters), ``too_long`` (> 1500 characters), ``non_ascii``
(> 5% of characters outside ASCII), ``not_english`` (>= 8 words and < 10% of them common
English function words), ``repetitive`` (a character repeated 10+ times in a row, one word 4+
times in a row, or fewer than half of the word 3-grams distinct).

Deduplication: text is normalised (lower case, every run of non-alphanumerics -> one space);
``duplicate`` = same normalised text, or word-3-gram Jaccard similarity >= 0.5 (texts of fewer
than 3 words are one shingle) with an earlier kept prompt or any other training prompt (GSM8K
train, self-instruct minus its held-out slice); ``eval_overlap`` = the same test against every
fixed evaluation set (``benchmarks/data/*.jsonl``, the held-out self-instruct slice, GSM8K
test), so training never contains an evaluation prompt even if the evaluation set is written
first. Second turns are deduplicated among second turns only (a generic "Thank you!" after
different answers is kept once) and checked against the evaluation sets.

    python scripts/self_synth.py prompts --out DIR --num 12000            # first user turns
    python scripts/self_synth.py turn2 --out DIR --num 3000               # needs answers in DIR
    python scripts/self_synth.py heldout --seed 1 --num 200 --out-file benchmarks/data/selfgen_heldout.jsonl
    python scripts/self_synth.py pipeline --out DIR --num 12000 --turn2 3000 --num-gsm8k 7473
    python scripts/self_synth.py summary --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

USER_HEADER = "<|im_start|>user\n"
SEED_STRIDE = 10**7  # sample i of seed s uses s * SEED_STRIDE + i

# --------------------------------------------------------------------------- pure text functions

MIN_WORDS, MIN_CHARS, MAX_CHARS = 3, 12, 1500
MAX_NON_ASCII = 0.05
ENGLISH_MIN_WORDS, ENGLISH_MIN_FRACTION = 8, 0.10
NGRAM, JACCARD = 3, 0.5

_FUNCTION_WORDS = frozenset("""
a an the and or but if of to in on at by for with from as about into over after before is are
was were be been being am do does did have has had can could will would should may might must
i you he she it we they me my your our their his her its this that these those what which who
how why when where there here not no so than then too very just all any some more most such
please help me tell give explain write make want need like know
""".split())

_NON_ALNUM = re.compile(r"[^0-9a-z]+")

# --topic presets: the system turn the target sees while writing user turns, and the pattern a
# kept turn must match. "code": programming requests (the target's plain chat template yields
# few; of 3,584 turns written under this system turn 47% were kept, 29% were off topic and
# 23% truncated).
TOPICS = {
    "code": (
        "You are a programming assistant. The user asks for code: functions, scripts, queries, "
        "bug fixes and explanations of programming concepts.",
        r"```|c\+\+|\b(code|coding|python|java|javascript|typescript|rust|golang|sql|bash|shell"
        r"|script|snippet|function|program|programming|algorithm|implement|regex"
        r"|regular expression|html|css|json|compiler|debug|recursion|recursive|database|query"
        r"|queries|git|api|class|array|linked list|loop|variable|pandas|numpy|linux|docker"
        r"|dockerfile|flask|django|react|unit test|syntax|thread|mutex|stack|queue|hash table"
        r"|big o|complexity|integer|string|data structure|software|developer)s?\b",
    ),
}


def normalise(text: str) -> str:
    """Lower case, every run of characters other than ASCII letters and digits -> one space."""
    return _NON_ALNUM.sub(" ", text.lower()).strip()


def shingles(text: str, n: int = NGRAM) -> frozenset[str]:
    """Word n-grams of the normalised text; a text of fewer than n words is one shingle."""
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


class NearDupIndex:
    """Exact (normalised) and near-duplicate (word n-gram Jaccard) lookup over a growing set.

    An inverted index from shingle to entries makes each lookup proportional to the entries
    sharing a shingle, not to the whole set, so it stays fast at tens of thousands of prompts."""

    def __init__(self, n: int = NGRAM, threshold: float = JACCARD) -> None:
        self.n, self.threshold = n, threshold
        self.exact: set[str] = set()
        self.sets: list[frozenset[str]] = []
        self.postings: dict[str, list[int]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.sets)

    def add(self, text: str) -> None:
        self.exact.add(normalise(text))
        s = shingles(text, self.n)
        idx = len(self.sets)
        self.sets.append(s)
        for g in s:
            self.postings[g].append(idx)

    def similar(self, text: str) -> bool:
        """True if ``text`` equals an entry after normalisation or shares at least
        ``threshold`` (Jaccard) of its word n-grams with one."""
        if normalise(text) in self.exact:
            return True
        s = shingles(text, self.n)
        shared: Counter[int] = Counter()
        for g in s:
            shared.update(self.postings.get(g, ()))
        for idx, inter in shared.items():
            other = self.sets[idx]
            if inter / (len(s) + len(other) - inter) >= self.threshold:
                return True
        return False


def repetitive(text: str) -> bool:
    """Degenerate repetition: a character 10+ times in a row, a word 4+ times in a row, or
    fewer than half of the word 3-grams distinct (counted once there are 10 or more)."""
    if re.search(r"(.)\1{9,}", text):
        return True
    words = normalise(text).split()
    run = 1
    for prev, cur in zip(words, words[1:]):
        run = run + 1 if cur == prev else 1
        if run >= 4:
            return True
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return len(grams) >= 10 and len(set(grams)) < 0.5 * len(grams)


def filter_reason(text: str, finish_reason: str | None = "stop",
                  token_ids: list[int] | None = None, special_ids: frozenset[int] = frozenset()
                  ) -> str | None:
    """Why a sampled user turn is dropped (the first failing filter), or None to keep it."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason == "context":
        return "context_too_long"
    # the closing <|im_end|> is the stop token and may be the last id; any other is a leak
    body = list(token_ids or [])
    if body and body[-1] in special_ids:
        body = body[:-1]
    if "<|im_" in text or any(t in special_ids for t in body):
        return "special_token"
    words = text.split()
    if len(words) < MIN_WORDS or len(text.strip()) < MIN_CHARS:
        return "too_short"
    if len(text) > MAX_CHARS:
        return "too_long"
    if sum(ord(c) > 127 for c in text) > MAX_NON_ASCII * len(text):
        return "non_ascii"
    norm = normalise(text).split()
    if len(norm) >= ENGLISH_MIN_WORDS and \
            sum(w in _FUNCTION_WORDS for w in norm) < ENGLISH_MIN_FRACTION * len(norm):
        return "not_english"
    if repetitive(text):
        return "repetitive"
    return None


def select(samples: list[dict], seen: NearDupIndex, evals: NearDupIndex,
           special_ids: frozenset[int] = frozenset(), require: str | None = None
           ) -> tuple[list[dict], dict]:
    """Filter then deduplicate raw samples in index order. ``seen`` (other training prompts)
    grows with every kept sample; ``evals`` holds the fixed evaluation prompts; ``require``
    (a regular expression, case-insensitive) drops turns that do not match it as
    ``off_topic``. Returns the kept samples and counts per reason (``kept`` included)."""
    counts: Counter[str] = Counter()
    kept = []
    topic = re.compile(require, re.IGNORECASE) if require else None
    for row in sorted(samples, key=lambda r: r["index"]):
        text = row["text"].strip()
        reason = filter_reason(text, row.get("finish_reason"), row.get("token_ids"), special_ids)
        if reason is None and topic is not None and not topic.search(text):
            reason = "off_topic"
        if reason is None and evals.similar(text):
            reason = "eval_overlap"
        if reason is None and seen.similar(text):
            reason = "duplicate"
        counts[reason or "kept"] += 1
        if reason is None:
            seen.add(text)
            kept.append({**row, "text": text})
    return kept, {"samples": len(samples), **{k: counts[k] for k in sorted(counts)}}


def sample_seed(seed: int, index: int) -> int:
    return seed * SEED_STRIDE + index


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- prompt sets

def eval_prompts() -> list[str]:
    """Every fixed evaluation prompt: benchmarks/data/*.jsonl, held-out self-instruct, GSM8K test."""
    from benchmarks import prompts as prompt_sets
    from dflash_data import held_out_prompts

    out = list(held_out_prompts())
    out += prompt_sets.gsm8k_questions("test")
    for path in sorted((ROOT / "benchmarks" / "data").glob("*.jsonl")):
        out += [r.get("prompt") or r.get("question") or "" for r in read_jsonl(path)]
    return [p for p in out if p]


def index_of(texts) -> NearDupIndex:
    idx = NearDupIndex()
    for t in texts:
        idx.add(t)
    return idx


def base_training_prompts(num_gsm8k: int, gsm8k_from: int = 0) -> list[str]:
    from dflash_data import training_prompts

    return [r["prompt"] for r in training_prompts(num_gsm8k, gsm8k_from=gsm8k_from)]


def earlier_prompts(dirs: list[Path], name: str) -> list[str]:
    """The self-generated prompts kept in earlier data folders (``--dedup-against``), so a new
    piece of data does not repeat them."""
    return [r["prompt"] for d in dirs for r in read_jsonl(d / name)]


# --------------------------------------------------------------------------- sampling

def make_llm(args):
    from engine import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, speculative_config=None,
               max_model_len=args.max_model_len, max_num_seqs=args.batch)


def user_prefix(tok, history: list[str], system: str | None = None) -> str:
    """Chat template text up to and including ``<|im_start|>user\\n``; ``history`` alternates
    user and assistant turns (empty: the bare template). ``system`` replaces the template's
    default system turn (a steer for what the user writes about; the answers are generated
    later without it)."""
    head = [{"role": "system", "content": system}] if system else []
    if not history:
        t = tok.apply_chat_template(head + [{"role": "user", "content": "\x00"}], tokenize=False,
                                    add_generation_prompt=False)
        return t[: t.index("\x00")]
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": m}
            for i, m in enumerate(history)]
    return tok.apply_chat_template(head + msgs, tokenize=False) + USER_HEADER


def sample_turns(llm, jobs: list[dict], raw_path: Path, args, deadline: float | None) -> dict:
    """Sample a user turn for every job (``index``, ``history``, optional extra fields), ``--chunk``
    prompts per ``LLM.generate`` call; each finished chunk is appended to ``raw_path``."""
    from engine import SamplingParams

    tok = llm.get_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tokens, start, done = 0, time.perf_counter(), 0
    with raw_path.open("a") as f:
        for c0 in range(0, len(jobs), args.chunk):
            if deadline is not None and time.time() > deadline:
                print("time limit reached", flush=True)
                break
            chunk = jobs[c0 : c0 + args.chunk]
            prompts = [tok.encode(user_prefix(tok, j.get("history", []), args.user_system))
                       for j in chunk]
            # a conversation too long to leave room for the turn is recorded, not sampled
            fits = [len(ids) + args.max_user_tokens <= args.max_model_len for ids in prompts]
            for j, ok in zip(chunk, fits):
                if not ok:
                    f.write(json.dumps({**j, "seed": sample_seed(args.seed, j["index"]), "text": "",
                                        "finish_reason": "context", "token_ids": []}) + "\n")
            chunk = [j for j, ok in zip(chunk, fits) if ok]
            prompts = [ids for ids, ok in zip(prompts, fits) if ok]
            params = [SamplingParams(max_tokens=args.max_user_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=sample_seed(args.seed, j["index"]),
                                     stop_token_ids=[im_end]) for j in chunk]
            outs = llm.generate(prompts, params) if prompts else []
            for j, o in zip(chunk, outs):
                c = o.outputs[0]
                tokens += len(c.token_ids)
                f.write(json.dumps({**j, "seed": sample_seed(args.seed, j["index"]),
                                    "text": c.text, "finish_reason": c.finish_reason,
                                    "token_ids": list(c.token_ids)}) + "\n")
            f.flush()
            done += len(chunk)
            rate = tokens / (time.perf_counter() - start)
            print(f"{raw_path.name}: {done}/{len(jobs)} samples, {rate:.0f} tok/s", flush=True)
    secs = time.perf_counter() - start
    return {"samples": done, "tokens": tokens, "seconds": round(secs, 1),
            "tok_s": round(tokens / secs, 1) if secs else None}


def special_ids_of(llm) -> frozenset[int]:
    return frozenset(llm.get_tokenizer().all_special_ids)


# --------------------------------------------------------------------------- steps

def _stats_update(out: Path, key: str, value: dict) -> None:
    path = out / "selfgen_stats.json"
    stats = json.loads(path.read_text()) if path.exists() else {}
    stats[key] = value
    path.write_text(json.dumps(stats, indent=2))


def first_turns(args, llm=None, deadline: float | None = None) -> list[dict]:
    """Sample first user turns until ``--num`` are kept (or ``--max-samples`` / the deadline)."""
    args.out.mkdir(parents=True, exist_ok=True)
    raw_path = args.out / "selfgen_raw.jsonl"
    evals = index_of(eval_prompts())
    base = base_training_prompts(args.num_gsm8k, args.gsm8k_from)
    base += earlier_prompts(args.dedup_against, "selfgen_prompts.jsonl")
    gen = None
    while True:
        raw = read_jsonl(raw_path)
        kept, counts = select(raw, index_of(base), evals,
                              special_ids_of(llm) if llm else frozenset({0, 1, 2}), args.require)
        print(f"selfgen: {len(kept)} kept of {len(raw)} samples {counts}", flush=True)
        if len(kept) >= args.num or len(raw) >= args.max_samples or \
                (deadline is not None and time.time() > deadline):
            break
        llm = llm or make_llm(args)
        # one chunk at a time, so selection is rechecked (and sampling stops) as soon as enough
        # are kept
        start = max((r["index"] for r in raw), default=-1) + 1
        want = min(args.chunk, args.max_samples - len(raw))
        gen = sample_turns(llm, [{"index": i} for i in range(start, start + want)], raw_path,
                           args, deadline)
        _stats_update(args.out, "selfgen_last_generation", gen)
    kept = kept[: args.num]
    counts["written"] = len(kept)  # kept beyond --num (the last chunk's surplus) wait for a larger --num
    with (args.out / "selfgen_prompts.jsonl").open("w") as f:
        for r in kept:
            f.write(json.dumps({"source": "selfgen", "prompt": r["text"], "index": r["index"]}) + "\n")
    _stats_update(args.out, "selfgen", counts)
    _stats_update(args.out, "selfgen_steer", {"user_system": args.user_system,
                                              "require": args.require})
    return kept


def _answered_first_turns(out: Path, tok) -> list[dict]:
    """Self-generated first turns with a complete greedy answer in ``sequences.jsonl``."""
    rows = []
    for r in read_jsonl(out / "sequences.jsonl"):
        if r.get("source") == "selfgen" and r.get("finish_reason") == "stop" and not r.get("history"):
            answer = tok.decode(r["response_ids"], skip_special_tokens=True).strip()
            if answer:
                rows.append({"history": [r["prompt"], answer]})
    return rows


def second_turns(args, llm=None, deadline: float | None = None) -> list[dict]:
    """A second user turn after each answered self-generated first turn (in answer order)
    until ``--turn2`` are kept."""
    raw_path = args.out / "selfgen_turn2_raw.jsonl"
    evals = index_of(eval_prompts())
    llm = llm or make_llm(args)
    parents = _answered_first_turns(args.out, llm.get_tokenizer())
    earlier = earlier_prompts(args.dedup_against, "selfgen_turn2_prompts.jsonl")
    while True:
        raw = read_jsonl(raw_path)
        kept, counts = select(raw, index_of(earlier), evals, special_ids_of(llm), args.require)
        print(f"selfgen_turn2: {len(kept)} kept of {len(raw)} samples "
              f"({len(parents)} answered first turns) {counts}", flush=True)
        done = {r["index"] for r in raw}
        todo = [{"index": i, **p} for i, p in enumerate(parents) if i not in done]
        # the parents list only grows (answers are appended), so index i is stable
        if len(kept) >= args.turn2 or not todo or (deadline is not None and time.time() > deadline):
            break
        gen = sample_turns(llm, todo[: args.chunk], raw_path, args, deadline)
        _stats_update(args.out, "selfgen_turn2_last_generation", gen)
    kept = kept[: args.turn2]
    counts["written"] = len(kept)
    with (args.out / "selfgen_turn2_prompts.jsonl").open("w") as f:
        for r in kept:
            f.write(json.dumps({"source": "selfgen_turn2", "prompt": r["text"],
                                "history": r["history"], "index": r["index"]}) + "\n")
    _stats_update(args.out, "selfgen_turn2", counts)
    return kept


def heldout(args) -> None:
    """Fixed held-out chat prompts: seed ``--seed`` (not the training one), filtered, deduplicated
    among themselves, against the training prompts (base sets and any self-generated ones in
    ``--out``) and against the other evaluation sets."""
    if args.seed == 0:
        raise SystemExit("use a seed other than the training one (0)")
    raw_path = args.out / "selfgen_heldout_raw.jsonl" if args.raw is None else args.raw
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    train = base_training_prompts(args.num_gsm8k)
    train += [r["prompt"] for r in read_jsonl(args.out / "selfgen_prompts.jsonl")]
    train += [r["text"] for r in read_jsonl(args.out / "selfgen_raw.jsonl")]
    others = [p for p in eval_prompts()
              if p not in {r["prompt"] for r in read_jsonl(args.out_file)}]
    llm = None
    while True:
        raw = read_jsonl(raw_path)
        kept, counts = select(raw, index_of(train), index_of(others),
                              special_ids_of(llm) if llm else frozenset({0, 1, 2}), args.require)
        print(f"heldout: {len(kept)} kept of {len(raw)} {counts}", flush=True)
        if len(kept) >= args.num or len(raw) >= args.max_samples:
            break
        llm = llm or make_llm(args)
        start = max((r["index"] for r in raw), default=-1) + 1
        sample_turns(llm, [{"index": i} for i in range(start, start + args.chunk)], raw_path,
                     args, None)
    with args.out_file.open("w") as f:
        for r in kept[: args.num]:
            f.write(json.dumps({"prompt": r["text"]}) + "\n")
    print(json.dumps({"seed": args.seed, **counts}))


def summary(out: Path) -> dict:
    """The training mix in ``sequences.jsonl``: sequences and response tokens per source."""
    mix: dict[str, Counter] = defaultdict(Counter)
    for r in read_jsonl(out / "sequences.jsonl"):
        m = mix[r["source"]]
        m["sequences"] += 1
        m["response_tokens"] += len(r["response_ids"])
        m["prompt_tokens"] += len(r["prompt_ids"])
        m["hit_max_tokens"] += r.get("finish_reason") == "length"
    total = Counter()
    for m in mix.values():
        total.update(m)
    res = {"sources": {k: dict(v) for k, v in sorted(mix.items())}, "total": dict(total)}
    stats = out / "selfgen_stats.json"
    if stats.exists():
        res["selfgen_selection"] = json.loads(stats.read_text())
    return res


def pipeline(args) -> None:
    """Everything up to training, each step resumable: first turns, answers (all sources,
    interleaved), second turns, their answers, optionally features."""
    import dflash_data

    deadline = time.time() + args.time_limit if args.time_limit else None
    llm = make_llm(args)
    first_turns(args, llm, deadline)
    gen_argv = ["generate", "--out", str(args.out), "--model", args.model, "--dtype", args.dtype,
                "--device", args.device,
                "--num-gsm8k", str(args.num_gsm8k), "--gsm8k-from", str(args.gsm8k_from),
                "--max-tokens", str(args.max_tokens),
                "--max-model-len", str(args.max_model_len), "--batch", str(args.batch),
                "--interleave"]
    only = ["--sources", *args.sources] if args.sources else []
    first = deadline
    if deadline is not None and args.turn2:
        # a bounded run leaves a quarter of what remains for the second turns and their answers
        first = time.time() + 0.75 * max(0.0, deadline - time.time())
    dflash_data.main(gen_argv + only + (["--deadline", str(first)] if first else []), llm=llm)
    if args.turn2 and (deadline is None or time.time() < deadline) and \
            (not args.sources or "selfgen_turn2" in args.sources):
        second_turns(args, llm, deadline)
        dflash_data.main(gen_argv + ["--sources", "selfgen_turn2"]
                         + (["--deadline", str(deadline)] if deadline else []), llm=llm)
    if args.features and (deadline is None or time.time() < deadline):
        del llm
        dflash_data.main(["features", "--out", str(args.out), "--model", args.model,
                          "--dtype", args.dtype, "--device", args.device,
                          "--max-model-len", str(args.max_model_len)])
    print(json.dumps(summary(args.out), indent=2))


def main(argv: list[str] | None = None) -> None:
    import dflash_data

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["prompts", "turn2", "heldout", "pipeline", "summary"])
    p.add_argument("--out", type=Path, default=dflash_data.default_out(),
                   help="data folder (dflash_data.py's)")
    p.add_argument("--out-file", type=Path, default=ROOT / "benchmarks" / "data" / "selfgen_heldout.jsonl",
                   help="heldout: the evaluation file written")
    p.add_argument("--raw", type=Path, default=None,
                   help="heldout: raw samples file (default: OUT/selfgen_heldout_raw.jsonl)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--num", type=int, default=200, help="first user turns to keep")
    p.add_argument("--turn2", type=int, default=0, help="second user turns to keep")
    p.add_argument("--max-samples", type=int, default=10**6, help="stop sampling after this many")
    p.add_argument("--num-gsm8k", type=int, default=2400,
                   help="GSM8K train questions in the training set, from --gsm8k-from (0: all the rest)")
    p.add_argument("--gsm8k-from", type=int, default=0, help="first GSM8K train question used")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-user-tokens", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=256, help="pipeline: answer length cap")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=48, help="requests in flight")
    p.add_argument("--chunk", type=int, default=256, help="prompts per LLM.generate call")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds (prompts, turn2, pipeline): no new chunk or prompt after it")
    p.add_argument("--dedup-against", type=Path, nargs="+", default=[],
                   help="earlier data folders: their kept self-generated prompts count as "
                        "training prompts for deduplication")
    p.add_argument("--sources", nargs="+", choices=dflash_data.SOURCES, default=None,
                   help="pipeline: answer only these sources (dflash_data.py's names; "
                        "default: all)")
    p.add_argument("--topic", choices=sorted(TOPICS), default=None,
                   help="a preset --user-system and --require (either may still be given)")
    p.add_argument("--user-system", default=None,
                   help="system turn the target sees while it writes user turns (first and "
                        "second), e.g. to ask for programming requests; the answers are "
                        "generated with the default template. Use a fresh --out per steer: the "
                        "raw samples do not record it")
    p.add_argument("--require", default=None,
                   help="regular expression (case-insensitive) a user turn must match to be "
                        "kept; the others count as off_topic")
    p.add_argument("--features", action="store_true", help="pipeline: also extract features")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    args = p.parse_args(argv)
    if args.topic:
        system, pattern = TOPICS[args.topic]
        args.user_system = args.user_system or system
        args.require = args.require or pattern
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    deadline = time.time() + args.time_limit if args.time_limit else None
    if args.step == "prompts":
        first_turns(args, deadline=deadline)
    elif args.step == "turn2":
        second_turns(args, deadline=deadline)
    elif args.step == "heldout":
        heldout(args)
    elif args.step == "pipeline":
        pipeline(args)
    else:
        print(json.dumps(summary(args.out), indent=2))


if __name__ == "__main__":
    main()
