"""Speculation policy benchmark: no speculation vs fixed K vs the adaptive default.

Offline ``LLM.generate``, greedy, natural stops, the default model with its shipped DFlash
draft. Engines: no speculation, one fixed-K engine per ``--fixed-k`` (verifies K drafts every
step) and the adaptive default, each in a process of its own (as a server runs one engine;
sharing a process, they slowed each other by up to 5%). For each prompt set and concurrency they
run the same prompts, taking turns batch by batch in a rotating order while the others wait (a
slow minute of a shared machine then hits every engine alike; one engine after the other,
ratios moved by 10-20%); greedy outputs must agree token for token (the script counts
mismatches). Reports output tok/s over all batches, the ratio to no speculation as the median
of the per-batch ratios with their range (each batch ran the same prompts on both engines
within seconds; on a shared 2-vCPU machine, whole minutes run about 10% slower now and then),
the mean acceptance length of the verified drafts and, for the adaptive engine, how often each
k = 0..K was verified. Set ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` to
run torch's kernels as on a CPU without AVX-512.

``--lockstep``: the engines take turns every engine step instead of every batch, each running a
closed loop of C requests in flight (the next prompt submitted as one finishes, as under C
clients of a server); for a machine whose speed drifts within a batch. One ratio per row:

    python benchmarks/bench_spec_policy.py --lockstep --sets chat --concurrency 1 4 16 32 \
        --single-prompts 24 --prompts 80 --no-fixed-k

The engines measure their dtype choice and step costs afresh, in a measurement cache of this run
(``--measure-cache DIR`` to keep or share one): steps taking turns with other engines ran about
30% slower than a standalone engine's on a 2-vCPU AVX2 EPYC (48 against 62 tok/s plain), and
the costs they refine, saved to the user's cache, would be what the next server reads.

Sets: ``gsm8k`` (GSM8K test), ``chat`` (the 50 held-out self-instruct prompts plus
``benchmarks/data/chat_heldout.jsonl``, general chat and code requests written for this
benchmark; none of them was used to train the draft).

    python benchmarks/bench_spec_policy.py --concurrency 1 4 16 32 --max-tokens 128 --fixed-k 3 7
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmarks import prompts as prompt_sets  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.args import default_draft_for  # noqa: E402

CHAT_FILE = Path(__file__).resolve().parent / "data" / "chat_heldout.jsonl"


def chat_questions() -> list[str]:
    from dflash_data import held_out_prompts

    own = [r["prompt"] for r in prompt_sets.read_jsonl(CHAT_FILE)]
    # interleave, so that any prefix mixes both sources
    held = held_out_prompts()
    out = []
    for i in range(max(len(own), len(held))):
        out += [p[i] for p in (held, own) if i < len(p)]
    return out


def cpu_description() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(simd) or 'no AVX2'})"


class EngineProcess:
    """One engine in a process of its own, as a server runs it, driven over a pipe. Engines
    sharing one process slowed each other: a speculative engine that never drafted ran at
    0.95x no speculation next to the adaptive engine and 1.00x without it (GSM8K, 32
    requests)."""

    def __init__(self, spec: dict | None, common: dict, measure_cache: Path | None = None
                 ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_engine, args=(child, spec, common, measure_cache),
                                 daemon=True)
        self._proc.start()
        child.close()
        self.info = self._reply()  # waits until the engine is built

    def _reply(self) -> Any:
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def call(self, what: str, *args: Any) -> Any:
        self._conn.send((what, args))
        return self._reply()

    def close(self) -> None:
        self._conn.send(("exit", ()))
        self._proc.join(30)


def _serve_engine(conn: Any, spec: dict | None, common: dict, measure_cache: Path | None
                  ) -> None:
    import traceback

    if measure_cache is not None:  # this process's engine (engine.measure_cache)
        os.environ["SPECSERVE_CACHE_DIR"] = str(measure_cache)
    try:
        llm = LLM(speculative_config=spec, **common)
        proposer = llm.engine.proposer
        conn.send((True, {"dtype": str(llm.engine.config.model.dtype),
                          "k": proposer.num_drafts if proposer else 0,
                          "tree": None if proposer is None or proposer.tree is None
                          else [list(p) for p in proposer.tree.paths]}))
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send((False, traceback.format_exc()))
        return
    loop: Arrivals | None = None
    while True:
        what, args = conn.recv()
        if what == "exit":
            return
        try:
            if what == "chat":
                value = prompt_sets.chat(llm.get_tokenizer(), *args)
            elif what == "generate":
                start = time.perf_counter()
                outs = llm.generate(*args)
                value = (time.perf_counter() - start, [o.outputs[0].token_ids for o in outs])
            elif what == "open":  # a closed loop stepped from outside (see measure_lockstep)
                loop = Arrivals(llm, *args)
                value = None
            elif what == "steps":
                value = loop.steps(*args)
            elif what == "close":
                value, loop = loop.outputs(), None
            elif what == "stats":
                s = llm.get_spec_decoding_stats()
                value = (s.num_drafts, s.num_accepted_tokens, list(s.num_steps_by_k))
            else:
                raise ValueError(f"unknown command {what!r}")
            conn.send((True, value))
        except Exception:  # noqa: BLE001 - reported to the parent
            conn.send((False, traceback.format_exc()))


def measure(engines: dict[str, EngineProcess], prompts: list[str], concurrency: int,
            params: SamplingParams) -> dict[str, dict]:
    """Every engine runs the same prompts, ``concurrency`` at a time. The engines take turns
    batch by batch (the order rotating each batch; one runs while the others wait idle), so
    that a slow minute of the machine hits them all alike instead of whichever engine ran
    then."""
    names = list(engines)
    acc = {n: {"tokens": 0, "seconds": 0.0, "outputs": [], "batch_tok_s": []} for n in names}
    before = {n: e.call("stats") for n, e in engines.items()}
    batches = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
    for b, batch in enumerate(batches):
        for n in names[b % len(names):] + names[:b % len(names)]:
            seconds, outs = engines[n].call("generate", batch, params)
            tokens = sum(len(o) for o in outs)
            acc[n]["seconds"] += seconds
            acc[n]["tokens"] += tokens
            acc[n]["batch_tok_s"].append(tokens / seconds)
            acc[n]["outputs"] += outs
    res = {}
    for n, engine in engines.items():
        a = acc[n]
        res[n] = {"tok_s": a["tokens"] / a["seconds"], "tokens": a["tokens"],
                  "seconds": a["seconds"], "outputs": a["outputs"],
                  "batch_tok_s": a["batch_tok_s"], **_spec_delta(before[n], engine.call("stats"))}
    return res


class Arrivals:
    """A closed loop inside one engine: ``concurrency`` requests in flight, the next prompt
    submitted as one finishes (as under that many clients of a server), advanced a few engine
    steps at a time by the caller."""

    def __init__(self, llm: LLM, prompts: list[str], params: SamplingParams,
                 concurrency: int) -> None:
        self.engine = llm.engine
        self.ids = [llm._tokenize(p)[1] for p in prompts]
        self.params, self.concurrency = params, concurrency
        self.next = self.live = 0
        self.done: dict[int, list[int]] = {}

    def steps(self, n: int) -> tuple[float, bool]:
        """Run up to ``n`` engine steps; returns their seconds and whether every prompt is done."""
        engine = self.engine
        start = time.perf_counter()
        for _ in range(n):
            while self.live < self.concurrency and self.next < len(self.ids):
                engine.add_request(str(self.next), self.ids[self.next], self.params)
                self.next += 1
                self.live += 1
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    self.live -= 1
                    self.done[int(out.request_id)] = list(out.outputs[0].token_ids)
        finished = self.next == len(self.ids) and not engine.has_unfinished_requests()
        return time.perf_counter() - start, finished

    def outputs(self) -> list[list[int]]:
        return [self.done[i] for i in range(len(self.ids))]


def measure_lockstep(engines: dict[str, EngineProcess], prompts: list[str], concurrency: int,
                     params: SamplingParams, turn_steps: int = 1) -> dict[str, dict]:
    """As :func:`measure`, but the engines take turns every ``turn_steps`` engine steps of a
    closed loop (:class:`Arrivals`), so drift of the machine within a batch hits them alike
    too. On a 2-vCPU AVX2 EPYC whose speed moved by 30% within a minute, batch-by-batch turns
    (or separate servers) could not resolve a few percent; stepping in turn, two engines
    without speculation measured 0.992x each other over 80 prompts at 32 streams. One
    ratio per run (no per-batch spread)."""
    names = list(engines)
    before = {n: e.call("stats") for n, e in engines.items()}
    for engine in engines.values():
        engine.call("open", prompts, params, concurrency)
    seconds = dict.fromkeys(names, 0.0)
    running = list(names)
    turn = 0
    while running:
        for n in running[turn % len(running):] + running[:turn % len(running)]:
            spent, finished = engines[n].call("steps", turn_steps)
            seconds[n] += spent
            if finished:
                running.remove(n)
        turn += 1
    res = {}
    for n, engine in engines.items():
        outs = engine.call("close")
        tokens = sum(len(o) for o in outs)
        res[n] = {"tok_s": tokens / seconds[n], "tokens": tokens, "seconds": seconds[n],
                  "outputs": outs, "batch_tok_s": [tokens / seconds[n]],
                  **_spec_delta(before[n], engine.call("stats"))}
    return res


def _spec_delta(before: tuple, after: tuple) -> dict:
    (d0, a0, k0), (d1, a1, k1) = before, after
    drafts, accepted = d1 - d0, a1 - a0
    return {"acceptance_length": 1 + accepted / drafts if drafts else None,
            "steps_by_k": [x - y for x, y in zip(k1, k0)] if k0 else []}


def leading_tree_paths(draft: Path, n: int) -> list[list[int]]:
    """The first ``n`` paths of the draft's ``tree.json`` (a tree: each path's parent precedes it)."""
    tree_file = draft / "tree.json"
    if not tree_file.exists():
        raise SystemExit(f"--fixed-tree needs {tree_file}")
    paths = json.loads(tree_file.read_text())["paths"]
    if not 1 <= n <= len(paths):
        raise SystemExit(f"--fixed-tree {n}: the draft's tree has {len(paths)} nodes")
    return [list(p) for p in paths[:n]]


def paired_ratios(res: dict[str, dict], name: str, base: str = "none") -> list[float]:
    """``name``'s speed over ``base``'s, batch by batch: each pair ran the same prompts within
    seconds of each other, so a noisy minute of the machine moves one pair, not the median."""
    return [a / b for a, b in zip(res[name]["batch_tok_s"], res[base]["batch_tok_s"])]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--sets", nargs="+", default=["gsm8k", "chat"], choices=["gsm8k", "chat"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    p.add_argument("--single-prompts", type=int, default=4,
                   help="prompts run one at a time for the single-stream figure")
    p.add_argument("--waves", type=int, default=1,
                   help="batches of C prompts per concurrency level C > 1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--fixed-k", nargs="+", type=int, default=[7],
                   help="fixed-K engines to compare (each verifies K drafts every step)")
    p.add_argument("--tree", type=Path, nargs="+", default=[],
                   help="tree.json files (engine.spec.tree): one more adaptive engine each, "
                        "named after the file, verifying leading nodes of that tree (in the "
                        "file's order, its conditional the prior) instead of the draft's own; "
                        "fixed-K engines always verify chains")
    p.add_argument("--fixed-tree", nargs="+", type=int, default=[],
                   help="fixed engines verifying the draft's first N tree nodes every step "
                        "(one engine per N; the draft's tree.json, leading paths)")
    p.add_argument("--chain-too", action="store_true",
                   help="also run the adaptive engine on chains (\"tree\": \"chain\")")
    p.add_argument("--fixed-order-too", action="store_true",
                   help="also run the adaptive engine verifying the tree's nodes in its fixed "
                        "order (\"tree_order\": \"fixed\"), not each block's confidence order")
    p.add_argument("--lockstep", action="store_true",
                   help="engines take turns step by step, each running a closed loop of "
                        "C requests in flight (measure_lockstep) instead of batch by batch")
    p.add_argument("--prompts", type=int, default=None,
                   help="with --lockstep: prompts per concurrency level > 1 (default C x waves)")
    p.add_argument("--no-fixed-k", action="store_true", help="no fixed-K engines")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--measure-cache", type=Path, default=None,
                   help="measurement cache of the engines (default: a new one for this run)")
    args = p.parse_args(argv)
    if args.no_fixed_k:
        args.fixed_k = []
    draft = default_draft_for(args.model) if args.draft == "default" else Path(args.draft)
    if draft is None:
        raise SystemExit("No shipped draft for this model; pass --draft PATH")
    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048,
                  max_num_seqs=max(args.concurrency))
    specs = {"none": None}
    for k in args.fixed_k:
        specs[f"K={k}"] = {"method": "dflash", "model": str(draft), "adaptive": False,
                           "num_speculative_tokens": k, "tree": "chain"}
    for n in args.fixed_tree:
        paths = leading_tree_paths(draft, n)
        specs[f"tree {n}"] = {"method": "dflash", "model": str(draft), "adaptive": False,
                              "num_speculative_tokens": max(map(len, paths)), "tree": paths}
    if args.chain_too:
        specs["adaptive chain"] = {"method": "dflash", "model": str(draft), "tree": "chain"}
    if args.fixed_order_too:
        specs["adaptive fixed order"] = {"method": "dflash", "model": str(draft),
                                         "tree_order": "fixed"}
    for path in args.tree:
        specs[f"adaptive {path.stem}"] = {"method": "dflash", "model": str(draft),
                                          "tree": json.loads(path.read_text())}
    specs["adaptive"] = {"method": "dflash", "model": str(draft)}
    systems = list(specs)
    cache = args.measure_cache or Path(tempfile.mkdtemp(prefix="specserve-bench-measurements-"))
    t0 = time.perf_counter()
    engines = {name: EngineProcess(specs[name], common, cache) for name in systems}  # in turn
    startup = time.perf_counter() - t0
    k = engines["adaptive"].info["k"]
    questions = {"gsm8k": lambda n: prompt_sets.gsm8k_questions("test", n),
                 "chat": lambda n: chat_questions()[:n]}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    warm = engines["none"].call("chat", ["Say hello."])
    for engine in engines.values():
        engine.call("generate", warm, params)
    tree = engines["adaptive"].info["tree"]
    report = {"cpu": cpu_description(), "dtype": engines["none"].info["dtype"],
              "k_max": k, "tree": tree, "max_tokens": args.max_tokens, "startup_s": startup,
              "rows": []}
    print(f"# {report['cpu']}, {report['dtype']}, K <= {k}, {args.max_tokens} tokens, greedy"
          + (f"; adaptive verifies leading nodes of the draft's tree ({len(tree)} nodes)"
             if tree else ""))
    spec_systems = systems[1:]
    print("| set | concurrency | none tok/s | " + " | ".join(f"{s} tok/s (x)" for s in spec_systems)
          + " | acceptance " + " / ".join(spec_systems) + " | adaptive k = 0..K | mismatches |")
    print("|---" * (len(spec_systems) + 5) + "|")
    for set_name in args.sets:
        for c in args.concurrency:
            n = args.single_prompts if c == 1 else (
                args.prompts if args.lockstep and args.prompts else c * args.waves)
            prompts = engines["none"].call("chat", questions[set_name](n))
            res = (measure_lockstep if args.lockstep else measure)(engines, prompts, c, params)
            base = res["none"]["outputs"]
            mismatches = sum(res[s]["outputs"] != base for s in spec_systems)
            report["rows"].append({
                "set": set_name, "concurrency": c, "prompts": len(prompts),
                "mismatches": mismatches,
                **{name: {key: v for key, v in r.items() if key != "outputs"}
                   for name, r in res.items()}})
            none = res["none"]["tok_s"]

            def acc(s: str) -> str:
                a = res[s]["acceptance_length"]
                return f"{a:.2f}" if a else "-"

            def cell(s: str) -> str:
                r = paired_ratios(res, s)
                spread = f", {min(r):.2f}-{max(r):.2f}" if len(r) > 1 else ""
                return f"{res[s]['tok_s']:.1f} ({statistics.median(r):.2f}x{spread})"

            cells = [cell(s) for s in spec_systems]
            print(f"| {set_name} | {c} | {none:.1f} | " + " | ".join(cells) + " | "
                  + " / ".join(acc(s) for s in spec_systems) + " | "
                  + "/".join(map(str, res["adaptive"]["steps_by_k"])) + f" | {mismatches} |",
                  flush=True)
    for engine in engines.values():
        engine.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
