"""Load-test any OpenAI-compatible server with streamed requests, like ``vllm bench serve``.

    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 \\
        --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos \\
        --num-prompts 64 --max-concurrency 8 --result-file result.json
    specserve bench serve --dataset-name gsm8k --endpoint /v1/chat/completions --request-rate 2

What it does, in order: GET ``/health`` (a failure is reported and recorded, and the run goes on so
that the failed requests get counted), find the model through ``/v1/models`` unless ``--model``
is given, send ``--num-warmups`` untimed requests, read ``/metrics``, send the measured requests
(closed loop with ``--max-concurrency``, open loop with ``--request-rate`` and Gamma-distributed
gaps: ``--burstiness 1`` gives Poisson arrivals, ``inf`` a fixed interval), read ``/metrics`` again,
then print a report and write one JSON file (config, aggregates, server-metric deltas,
per-request records). It talks only to ``--base-url`` (proxies from the environment are ignored)
and is bounded: ``--num-prompts`` requests (default 100), or until ``--duration`` seconds have
passed when that is given, and every request is cut off after ``--request-timeout`` seconds.

Definitions (measured on the client with ``time.perf_counter``):
  * an *output event* is a streamed chunk carrying new text (``choices[0].text`` or
    ``choices[0].delta.content``) or a ``finish_reason``; the chat role-only first chunk is not one;
  * TTFT = send -> first output event; E2EL = send -> end of the stream (``[DONE]``);
  * ITL = gaps between consecutive output events (a chunk holding several speculative tokens gives
    one gap), pooled over all requests; TPOT = (E2EL - TTFT) / (output_tokens - 1) per request;
  * output tokens come from the ``usage`` chunk (``stream_options.include_usage``). If a server
    sends none, they are counted by tokenizing the generated text with ``--tokenizer`` when one is
    available (records say ``"output_tokens_source": "tokenizer"``), never by counting chunks.
  * speculative decoding (from the ``/metrics`` deltas): acceptance rate = accepted / draft tokens,
    mean acceptance length = 1 + accepted / drafts (the bonus token included, as in vLLM),
    per-position acceptance = accepted_per_pos[i] / drafts.

A request *fails* on a connection error, a timeout, a non-200 status, an error event in the stream,
a stream that ends without ``[DONE]``, or a stream with no output at all. Failures are counted in
the report and the JSON (with up to five sample error bodies), never dropped.

Exit status: 0 when the run finished; 1 when no request succeeded, when the failure rate is above
``--max-failure-rate`` (not checked unless given, so by default failures alone do not change the
status as long as one request succeeded), or when fewer than ``--min-goodput-ratio`` of the
requests meet the ``--goodput`` SLOs; 2 for bad arguments or when no model name can be found.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_PERCENTILES = (90.0, 99.0)
METRIC_KEYS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
ERROR_BODY_CHARS = 500
SAMPLE_ERRORS = 5

# A fixed vocabulary for the "words" flavour of the random dataset (mostly one token each).
_WORD_TEXT = """
the of and to in is was for on are with as by at from or an be this which that have not it but
all were when we there can been has more if will one about up out them some time these so would
other into its then two first water long little very after word called just where most know get
through back much before go good new write our used me man too any day same right look think also
around another came come work three must because does part even place well such here take why help
put different away again off went old number great tell men say small every found still between
name should home big give air line set own under read last never us left end along while might next
sound below saw something thought both few those always show large often together asked house world
going want school important until form food keep children feet land side without boy once animal
life
enough took sometimes four head above kind began almost live page got earth need far hand high year
mother light country father let night picture being study second soon story since white ever paper
hard near sentence better best across during today however sure knew try told young sun thing whole
hear example heard several change answer room sea against top turned learn point city play toward
five himself usually money seen car morning
"""
WORDS = tuple(_WORD_TEXT.split())


# ---------------------------------------------------------------------------------------------
# Requests and datasets
# ---------------------------------------------------------------------------------------------


@dataclass
class SampleRequest:
    """One prompt to send: text, or token ids (``/v1/completions`` only)."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # known exactly for token-id prompts


def load_tokenizer(name_or_path: str | None) -> Any | None:
    """A ``tokenizers.Tokenizer`` for a folder, a ``tokenizer.json`` or a built-in model name."""
    if not name_or_path:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        try:  # this repository's built-in names (no download: resolve imports a local GGUF)
            from models.resolve import builtin_model_name, resolve_model_path

            if builtin_model_name(str(name_or_path)) is None:
                return None
            path = resolve_model_path(str(name_or_path)) / "tokenizer.json"
        except Exception:  # noqa: BLE001 - no tokenizer is a normal outcome
            return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001
        return None


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _sample_len(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high) if high > low else low


def random_requests(n: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0, tokenizer: Any | None = None,
                    as_text: bool = False) -> list[SampleRequest]:
    """Random prompts. With a tokenizer: uniform random (non-special) token ids, of exactly the
    drawn length, sent as ids (or decoded when ``as_text``, e.g. for chat); without one: random
    common words (about one token each). ``prefix_len`` tokens/words are shared by every prompt."""
    rng = random.Random(seed)
    if tokenizer is not None:
        special = set()
        try:
            special = set(tokenizer.get_added_tokens_decoder())
        except AttributeError:
            pass
        vocab = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
        prefix = [rng.choice(vocab) for _ in range(prefix_len)]
        out = []
        for _ in range(n):
            length = _sample_len(rng, input_len, range_ratio)
            ids = prefix + [rng.choice(vocab) for _ in range(length)]
            prompt: str | list[int] = tokenizer.decode(ids) if as_text else ids
            out.append(SampleRequest(prompt, _sample_len(rng, output_len, range_ratio),
                                     None if as_text else len(ids)))
        return out
    prefix_words = [rng.choice(WORDS) for _ in range(prefix_len)]
    return [SampleRequest(" ".join(prefix_words + [rng.choice(WORDS) for _ in range(
        _sample_len(rng, input_len, range_ratio))]), _sample_len(rng, output_len, range_ratio))
        for _ in range(n)]


def dataset_requests(args: argparse.Namespace, n: int, tokenizer: Any | None,
                     chat: bool) -> list[SampleRequest]:
    from benchmarks import prompts as prompt_sets

    name = args.dataset_name
    if name == "random":
        kind = args.random_prompt_kind
        if kind == "tokens" and tokenizer is None:
            raise SystemExit("bench_serve: --random-prompt-kind tokens needs --tokenizer")
        use_tok = tokenizer if kind in ("tokens", "auto") else None
        return random_requests(n, args.random_input_len, args.random_output_len,
                               range_ratio=args.random_range_ratio,
                               prefix_len=args.random_prefix_len, seed=args.seed,
                               tokenizer=use_tok, as_text=chat)
    if name == "custom":
        if not args.dataset_path:
            raise SystemExit("bench_serve: --dataset-name custom needs --dataset-path FILE.jsonl")
        rows = prompt_sets.read_jsonl(Path(args.dataset_path))
        items = [(r.get("prompt") or r.get("question") or r.get("instruction"),
                  int(r.get("output_len") or r.get("max_tokens") or args.output_len)) for r in rows]
        items = [(p, o) for p, o in items if p]
    else:
        # every prompt of the set, once (the built-in chat set repeats itself up to any limit)
        whole = len(prompt_sets.CHAT_PROMPTS) if name == "chat" else 10**9
        items = [(p, args.output_len) for p in prompt_sets.load(name, whole)]
    if not items:
        raise SystemExit(f"bench_serve: dataset {name!r} has no prompts")
    if not args.no_shuffle:
        random.Random(args.seed).shuffle(items)
    reps = math.ceil(n / len(items))
    return [SampleRequest(p, o) for p, o in (items * reps)[:n]]


# ---------------------------------------------------------------------------------------------
# Statistics (pure functions, unit-tested on synthetic timings)
# ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values_s: Sequence[float], key: str, percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std and the requested percentiles of ``values_s`` (seconds), in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    keys = [f"mean_{key}_ms", f"median_{key}_ms", f"std_{key}_ms",
            *(f"p{p:g}_{key}_ms" for p in percentiles)]
    if not ms:  # None, not NaN: the JSON result stays strict JSON
        return dict.fromkeys(keys)
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    values = [mean, percentile(ms, 50), std, *(percentile(ms, p) for p in percentiles)]
    return dict(zip(keys, values))


def request_tpot(e2el: float, ttft: float, output_tokens: int | None) -> float | None:
    """Per-request time per output token after the first: (E2EL - TTFT) / (tokens - 1)."""
    if output_tokens is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def itl_gaps(event_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive output events (absolute times in seconds)."""
    return [b - a for a, b in itertools.pairwise(event_times)]


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for spec in specs or []:
        key, _, value = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad --goodput item {spec!r}: use ttft:MS, tpot:MS or e2el:MS")
        out[key] = float(value)
    return out


def aggregate(records: Sequence[dict[str, Any]], duration: float,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES,
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The vLLM-style aggregates over per-request records (see ``RequestRecord``)."""
    ok = [r for r in records if r["success"]]
    percentiles = tuple(percentiles)
    in_tok = sum(r["prompt_tokens"] or 0 for r in ok)
    counted = [r for r in ok if r["output_tokens"] is not None]
    out_tok = sum(r["output_tokens"] for r in counted)
    agg: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "total": len(records),
        "failure_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "duration": duration, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "requests_without_output_count": len(ok) - len(counted),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
    }
    series = {
        "ttft": [r["ttft"] for r in ok if r["ttft"] is not None],
        "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
        "itl": [g for r in ok for g in r["itl"]],
        "e2el": [r["e2el"] for r in ok],
    }
    for key in METRIC_KEYS:
        agg.update(describe(series[key], key, percentiles))
    if goodput:
        good = 0
        for r in ok:
            vals = {"ttft": r["ttft"], "tpot": r["tpot"], "e2el": r["e2el"]}
            if all(vals[k] is None or vals[k] * 1000.0 <= slo for k, slo in goodput.items()):
                good += 1
        agg["good_requests"] = good
        agg["request_goodput"] = good / duration if duration > 0 else 0.0
        agg["goodput_ratio"] = good / len(records) if records else 0.0
    return agg


# ---------------------------------------------------------------------------------------------
# Prometheus /metrics
# ---------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
COUNTERS = ("vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as (name, labels, value)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def metric_sum(samples: Sequence[tuple[str, dict[str, str], float]], name: str,
               **labels: str) -> float | None:
    """Sum of a counter/gauge over its series (any model/engine); counters match with or without
    the ``_total`` suffix. None when the metric is absent."""
    names = {name, name + "_total"} if not name.endswith("_total") else {name}
    found = [v for n, lab, v in samples
             if n in names and all(lab.get(k) == val for k, val in labels.items())]
    return sum(found) if found else None


def per_position(samples: Sequence[tuple[str, dict[str, str], float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for n, lab, v in samples:
        if n in (SPEC_PER_POS, SPEC_PER_POS + "_total") and "position" in lab:
            out[int(lab["position"])] = out.get(int(lab["position"]), 0.0) + v
    return out


def counter_snapshot(samples: Sequence[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    snap: dict[str, Any] = {name: metric_sum(samples, name) for name in COUNTERS}
    reasons = sorted({lab["finished_reason"] for n, lab, _ in samples
                      if n.startswith("vllm:request_success") and "finished_reason" in lab})
    snap["request_success_by_reason"] = {
        r: metric_sum(samples, "vllm:request_success", finished_reason=r) for r in reasons}
    snap["spec_decode_num_accepted_tokens_per_pos"] = per_position(samples)
    return snap


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counter differences, plus the speculative-decoding summary when the server exports it."""
    delta: dict[str, Any] = {k: _delta(before.get(k), after.get(k)) for k in COUNTERS}
    reasons = set(before["request_success_by_reason"]) | set(after["request_success_by_reason"])
    delta["request_success_by_reason"] = {
        r: (after["request_success_by_reason"].get(r) or 0)
        - (before["request_success_by_reason"].get(r) or 0) for r in sorted(reasons)}
    spec = None
    if after.get(SPEC_DRAFTS) is not None:
        drafts = delta[SPEC_DRAFTS] or 0.0
        drafted = delta[SPEC_DRAFT_TOKENS] or 0.0
        accepted = delta[SPEC_ACCEPTED] or 0.0
        pb, pa = before["spec_decode_num_accepted_tokens_per_pos"], after[
            "spec_decode_num_accepted_tokens_per_pos"]
        per_pos = [pa.get(i, 0.0) - pb.get(i, 0.0) for i in range(len(pa))]
        spec = {
            "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "accepted_per_position": per_pos,
            "acceptance_rate_per_position": [p / drafts if drafts else None for p in per_pos],
        }
    delta["spec_decode"] = spec
    return delta


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    duration: float | None = None
    num_warmups: int = 1
    ignore_eos: bool = False
    # how ignore_eos is asked for: the vLLM field, or min_tokens = max_tokens (for servers
    # without ignore_eos, e.g. llama-cpp-python's)
    ignore_eos_via: str = "ignore_eos"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 600.0
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput: dict[str, float] = field(default_factory=dict)
    metrics_interval: float = 1.0
    disable_tqdm: bool = False
    save_text: bool = False
    label: str | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def build_payload(cfg: BenchConfig, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": req.output_len, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.chat:
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        if cfg.ignore_eos_via == "min_tokens":
            body["min_tokens"] = req.output_len
        else:
            body["ignore_eos"] = True
    for key in ("temperature", "top_p", "top_k"):
        if getattr(cfg, key) is not None:
            body[key] = getattr(cfg, key)
    body.update(cfg.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> tuple[str, bool]:
    """(new text, finished?) of a completions or chat chunk's first choice."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", False
    c = choices[0]
    text = c.get("text")
    if text is None:
        text = (c.get("delta") or {}).get("content")
    return text or "", c.get("finish_reason") is not None


async def send_request(client: Any, cfg: BenchConfig, req: SampleRequest, index: int,
                       run_id: str, tokenizer: Any | None = None) -> dict[str, Any]:
    """Send one streamed request; return its record (never raises, except on cancellation)."""
    import httpx

    rec: dict[str, Any] = {
        "index": index, "request_id": request_uuid(run_id, index), "success": False, "error": None,
        "status": None, "prompt_len": req.prompt_len, "prompt_tokens": req.prompt_len,
        "max_tokens": req.output_len, "output_tokens": None, "output_tokens_source": None,
        "ttft": None, "tpot": None, "e2el": None, "itl": [], "num_output_events": 0,
        "finish_reason": None, "start": None,
    }
    text_parts: list[str] = []
    events: list[float] = []
    usage = None
    done = False
    start = time.perf_counter()
    rec["start"] = start
    try:
        async with client.stream("POST", cfg.endpoint, json=build_payload(cfg, req),
                                 headers={**_headers(cfg), "x-request-id": rec["request_id"]}
                                 ) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status_code}: {body[:ERROR_BODY_CHARS]}"
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    rec["error"] = f"bad SSE data: {data[:ERROR_BODY_CHARS]}"
                    return rec
                if "error" in chunk and not chunk.get("choices"):
                    rec["error"] = f"stream error: {json.dumps(chunk)[:ERROR_BODY_CHARS]}"
                    return rec
                text, finished = _chunk_text(chunk)
                if text or finished:
                    events.append(now)
                    text_parts.append(text)
                if finished:
                    rec["finish_reason"] = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
        end = time.perf_counter()
    except (httpx.HTTPError, OSError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
        return rec
    if not done:
        rec["error"] = "stream ended without data: [DONE]"
        return rec
    if not events:
        rec["error"] = "stream carried no output"
        return rec
    rec["success"] = True
    rec["ttft"] = events[0] - start
    rec["e2el"] = end - start
    rec["itl"] = itl_gaps(events)
    rec["num_output_events"] = len(events)
    text = "".join(text_parts)
    if usage and usage.get("completion_tokens") is not None:
        rec["output_tokens"] = int(usage["completion_tokens"])
        rec["output_tokens_source"] = "usage"
        if usage.get("prompt_tokens") is not None:
            rec["prompt_tokens"] = int(usage["prompt_tokens"])
    elif tokenizer is not None:
        rec["output_tokens"] = count_tokens(tokenizer, text)
        rec["output_tokens_source"] = "tokenizer"
    if rec["prompt_tokens"] is None and tokenizer is not None and isinstance(req.prompt, str):
        rec["prompt_tokens"] = count_tokens(tokenizer, req.prompt)
    rec["tpot"] = request_tpot(rec["e2el"], rec["ttft"], rec["output_tokens"])
    if cfg.save_text:
        rec["generated_text"] = text
    return rec


def request_uuid(run_id: str, index: int) -> str:
    """The ``x-request-id`` of request ``index``: a UUID4-shaped id derived from the run, since
    some servers (llama-cpp-python's) answer 400 to any other request id format."""
    digest = hashlib.sha256(f"{run_id}/{index}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


async def _timed(coro: Any, timeout: float, index: int, run_id: str) -> dict[str, Any]:
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        return {"index": index, "request_id": request_uuid(run_id, index), "success": False,
                "error": f"timeout: no complete response within {timeout:g} s", "status": None,
                "prompt_len": None, "prompt_tokens": None, "max_tokens": None,
                "output_tokens": None, "output_tokens_source": None, "ttft": None, "tpot": None,
                "e2el": None, "itl": [], "num_output_events": 0, "finish_reason": None,
                "start": None}


def arrival_gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Seconds to wait before each next request: 0 for an infinite rate, else Gamma(shape =
    burstiness, mean = 1/rate) (burstiness 1 = Poisson process, inf = fixed interval)."""
    while True:
        if math.isinf(rate):
            yield 0.0
        elif math.isinf(burstiness):
            yield 1.0 / rate
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def scrape_metrics(client: Any) -> list[tuple[str, dict[str, str], float]] | None:
    try:
        r = await client.get("/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)
    except Exception:  # noqa: BLE001 - a server without /metrics is fine
        return None


async def settled_metrics(client: Any, timeout: float = 3.0
                          ) -> list[tuple[str, dict[str, str], float]] | None:
    """``/metrics`` once the server looks idle: a server may publish a request's last chunk a
    moment before its counters move, so scrape until nothing runs or waits and two scrapes 50 ms
    apart agree (or ``timeout`` passes, e.g. when other clients keep it busy)."""
    deadline = time.perf_counter() + timeout
    last = await scrape_metrics(client)
    while last is not None and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
        cur = await scrape_metrics(client)
        if cur is None:
            return last
        idle = all(not metric_sum(cur, g) for g in GAUGES[1:])
        if idle and counter_snapshot(cur) == counter_snapshot(last):
            return cur
        last = cur
    return last


async def check_health(client: Any) -> dict[str, Any]:
    try:
        r = await client.get("/health", timeout=10.0)
        return {"ok": r.status_code == 200, "status": r.status_code,
                "error": None if r.status_code == 200 else r.text[:ERROR_BODY_CHARS]}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}


async def discover_model(client: Any, cfg: BenchConfig) -> str | None:
    try:
        r = await client.get("/v1/models", headers=_headers(cfg), timeout=10.0)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001
        return None


def make_client(cfg: BenchConfig, connections: int) -> Any:
    import httpx

    return httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"), trust_env=False,
        timeout=httpx.Timeout(cfg.request_timeout, connect=10.0),
        limits=httpx.Limits(max_connections=max(4, connections),
                            max_keepalive_connections=max(4, connections)))


async def run_benchmark(cfg: BenchConfig, requests: Sequence[SampleRequest],
                        tokenizer: Any | None = None, *, health: dict[str, Any] | None = None,
                        cycle: bool = False) -> dict[str, Any]:
    """Warm up, snapshot /metrics, send ``requests`` (stopping early once ``cfg.duration`` has
    passed, if set; with ``cycle`` the list is repeated until then), snapshot /metrics again and
    return the result dict. ``cfg.model`` must be set."""
    from tqdm import tqdm

    if not requests:
        raise ValueError("no requests to send")
    timed = cfg.duration is not None and cfg.duration > 0
    cycle = cycle and timed
    run_id = uuid.uuid4().hex[:8]
    width = cfg.max_concurrency or (64 if cycle else len(requests))
    async with make_client(cfg, min(width, 256)) as client:
        if health is None:
            health = await check_health(client)
        warm = []
        if cfg.num_warmups > 0:
            firsts = [requests[i % len(requests)] for i in range(cfg.num_warmups)]
            warm_reqs = [dataclasses.replace(r, output_len=min(r.output_len, 16)) for r in firsts]
            sem = asyncio.Semaphore(cfg.max_concurrency or len(warm_reqs))

            async def warm_one(i: int, r: SampleRequest) -> dict[str, Any]:
                async with sem:
                    return await _timed(send_request(client, cfg, r, i, run_id + "w"),
                                        cfg.request_timeout, i, run_id + "w")

            warm = await asyncio.gather(*(warm_one(i, r) for i, r in enumerate(warm_reqs)))
        before = await settled_metrics(client)

        peaks: dict[str, float] = {}
        stop_poll = asyncio.Event()

        async def poll() -> None:
            while not stop_poll.is_set():
                samples = await scrape_metrics(client)
                for name in GAUGES if samples else ():
                    v = metric_sum(samples, name)
                    if v is not None:
                        peaks[name] = max(peaks.get(name, v), v)
                try:
                    await asyncio.wait_for(stop_poll.wait(), cfg.metrics_interval)
                except asyncio.TimeoutError:
                    pass

        poller = asyncio.create_task(poll()) if cfg.metrics_interval > 0 and before else None
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=None if cycle else len(requests), disable=cfg.disable_tqdm,
                   desc=cfg.label or "requests", unit="req", dynamic_ncols=True, file=sys.stderr)
        in_flight = 0
        peak_in_flight = 0
        records: list[dict[str, Any]] = []

        async def one(i: int, r: SampleRequest) -> None:
            nonlocal in_flight, peak_in_flight
            in_flight += 1
            peak_in_flight = max(peak_in_flight, in_flight)
            try:
                rec = await _timed(send_request(client, cfg, r, i, run_id, tokenizer),
                                   cfg.request_timeout, i, run_id)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
            records.append(rec)
            bar.update(1)

        rng = random.Random(cfg.seed)
        gaps = arrival_gaps(cfg.request_rate, cfg.burstiness, rng)
        tasks = []
        start = time.perf_counter()
        deadline = start + cfg.duration if timed else math.inf
        i = 0
        while cycle or i < len(requests):
            if sem is not None:
                try:
                    await asyncio.wait_for(sem.acquire(), max(0.0, deadline - time.perf_counter())
                                           if timed else None)
                except asyncio.TimeoutError:
                    break
            if time.perf_counter() >= deadline:
                if sem is not None:
                    sem.release()
                break
            tasks.append(asyncio.create_task(one(i, requests[i % len(requests)])))
            i += 1
            gap = next(gaps)
            if gap > 0:
                await asyncio.sleep(min(gap, max(0.0, deadline - time.perf_counter())))
            elif i % 64 == 0:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        if poller is not None:
            stop_poll.set()
            await poller
        after = await settled_metrics(client)

    records.sort(key=lambda r: r["index"])
    for r in records:
        if r["start"] is not None:
            r["start"] -= start
    agg = aggregate(records, duration, cfg.percentiles, cfg.goodput)
    agg["max_concurrent_requests"] = peak_in_flight
    server: dict[str, Any] = {"available": before is not None and after is not None}
    if server["available"]:
        snap_b, snap_a = counter_snapshot(before), counter_snapshot(after)
        server.update(before=snap_b, after=snap_a, delta=metrics_delta(snap_b, snap_a),
                      peak={k: peaks.get(k) for k in GAUGES})
    errors = list(dict.fromkeys(r["error"] for r in records if r["error"]))[:SAMPLE_ERRORS]
    config = dataclasses.asdict(cfg)
    config.pop("api_key")
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    config["burstiness"] = "inf" if math.isinf(cfg.burstiness) else cfg.burstiness
    return {
        "config": config,
        "environment": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
                        "python": sys.version.split()[0], "run_id": run_id},
        "health": health,
        "warmup": {"num": len(warm), "failed": sum(not w["success"] for w in warm),
                   "errors": list(dict.fromkeys(w["error"] for w in warm if w["error"]))[:3]},
        "aggregates": agg,
        "server_metrics": server,
        "errors": errors,
        "requests": records,
    }


# ---------------------------------------------------------------------------------------------
# Report, exit status, CLI
# ---------------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def format_report(result: dict[str, Any]) -> str:
    a, cfg = result["aggregates"], result["config"]
    rows: list[tuple[str, Any, str]] = [
        ("Successful requests:", a["completed"], "d"), ("Failed requests:", a["failed"], "d"),
        ("Maximum request concurrency:", cfg["max_concurrency"], ""),
        ("Request rate configured (RPS):", cfg["request_rate"], ""),
        ("Benchmark duration (s):", a["duration"], ".2f"),
        ("Total input tokens:", a["total_input_tokens"], "d"),
        ("Total generated tokens:", a["total_output_tokens"], "d"),
        ("Request throughput (req/s):", a["request_throughput"], ".2f"),
        ("Output token throughput (tok/s):", a["output_throughput"], ".2f"),
        ("Peak concurrent requests:", a["max_concurrent_requests"], "d"),
        ("Total token throughput (tok/s):", a["total_token_throughput"], ".2f"),
    ]
    if "request_goodput" in a:
        rows.append(("Request goodput (req/s):", a["request_goodput"], ".2f"))
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{_fmt(v, f) if f else _fmt(v, '')}" for k, v, f in rows]
    if a["requests_without_output_count"]:
        lines.append(f"{'Requests without a token count:':<40}{a['requests_without_output_count']}")
    pcts = [float(p) for p in cfg["percentiles"]]
    for key in METRIC_KEYS:
        short = key.upper() if key != "e2el" else "E2EL"
        lines.append("{s:{c}^50}".format(s=f"{METRIC_NAMES[key]}", c="-"))
        lines.append(f"{f'Mean {short} (ms):':<40}{_fmt(a[f'mean_{key}_ms'])}")
        lines.append(f"{f'Median {short} (ms):':<40}{_fmt(a[f'median_{key}_ms'])}")
        for p in pcts:
            lines.append(f"{f'P{p:g} {short} (ms):':<40}{_fmt(a[f'p{p:g}_{key}_ms'])}")
    server = result["server_metrics"]
    if server.get("available"):
        d = server["delta"]
        lines.append("{s:{c}^50}".format(s=" Server /metrics (delta) ", c="-"))
        reasons = {k: int(v) for k, v in d["request_success_by_reason"].items()}
        lines.append(f"{'Finished requests (by reason):':<40}{json.dumps(reasons)}")
        lines.append(f"{'Generation tokens:':<40}{_fmt(d['vllm:generation_tokens'], '.0f')}")
        lines.append(f"{'Preemptions:':<40}{_fmt(d['vllm:num_preemptions'], '.0f')}")
        peak_kv = server["peak"].get("vllm:kv_cache_usage_perc")
        lines.append(f"{'Peak KV-cache usage (%):':<40}"
                     f"{_fmt(peak_kv * 100 if peak_kv is not None else None)}")
        spec = d["spec_decode"]
        if spec:
            lines.append("{s:{c}^50}".format(s=" Speculative Decoding ", c="-"))
            rate = spec["acceptance_rate"]
            pct = rate * 100 if rate is not None else None
            lines.append(f"{'Acceptance rate (%):':<40}{_fmt(pct)}")
            lines.append(f"{'Acceptance length:':<40}{_fmt(spec['mean_acceptance_length'])}")
            lines.append(f"{'Drafts:':<40}{_fmt(spec['num_drafts'], '.0f')}")
            lines.append(f"{'Draft tokens:':<40}{_fmt(spec['num_draft_tokens'], '.0f')}")
            lines.append(f"{'Accepted tokens:':<40}{_fmt(spec['num_accepted_tokens'], '.0f')}")
            per = ", ".join(_fmt(p * 100 if p is not None else None, ".1f")
                            for p in spec["acceptance_rate_per_position"])
            lines.append(f"{'Per-position acceptance (%):':<40}{per}")
    elif server is not None:
        lines.append("(server /metrics not available: no server-side numbers)")
    if result["errors"]:
        lines.append("{s:{c}^50}".format(s=" Sample errors ", c="-"))
        lines += [f"  {e}" for e in result["errors"]]
    lines.append("=" * 50)
    return "\n".join(lines)


def exit_status(result: dict[str, Any], max_failure_rate: float | None,
                min_goodput_ratio: float | None = None) -> int:
    """0 = fine; 1 = nothing succeeded, failure rate above the limit, or goodput below it."""
    a = result["aggregates"]
    if a["completed"] == 0:
        return 1
    if max_failure_rate is not None and a["failure_rate"] > max_failure_rate:
        return 1
    if min_goodput_ratio is not None and a.get("goodput_ratio", 1.0) < min_goodput_ratio:
        return 1
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_serve", description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 ok; 1 no request succeeded, failure rate above --max-failure-rate "
               "or goodput ratio below --min-goodput-ratio; 2 bad arguments / no model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--backend", choices=("openai", "vllm", "openai-chat"), default=None,
                   help="vLLM-compatible alias: openai/vllm = /v1/completions, openai-chat = "
                        "/v1/chat/completions")
    t.add_argument("--endpoint", default=None, help="default /v1/completions")
    t.add_argument("--model", default=None, help="default: the first model of /v1/models")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer folder/tokenizer.json or built-in name (default: --model); "
                        "needed for random token-id prompts")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random",
                   choices=("random", "gsm8k", "self-instruct", "chat", "custom"))
    d.add_argument("--dataset-path", default=None,
                   help="JSONL with prompt (and output_len) for custom")
    d.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default 100; unbounded under --duration)")
    d.add_argument("--output-len", type=int, default=128, help="max_tokens for non-random datasets")
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--random-prompt-kind", choices=("auto", "tokens", "words"), default="auto",
                   help="token ids (exact lengths, needs a tokenizer) or random words")
    d.add_argument("--no-shuffle", action="store_true", help="keep the dataset's order")
    d.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s (inf = all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="Gamma shape of the gaps: 1 Poisson, <1 burstier, inf fixed interval")
    ld.add_argument("--max-concurrency", type=int, default=None)
    ld.add_argument("--duration", type=float, default=None,
                    help="stop sending new requests after this many seconds")
    ld.add_argument("--num-warmups", type=int, default=1)
    ld.add_argument("--request-timeout", type=float, default=600.0)
    s = p.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--temperature", type=float, default=None, help="default: the server's")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    r = p.add_argument_group("report")
    r.add_argument("--metric-percentiles", default="90,99",
                   help="reported next to mean and median")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    r.add_argument("--min-goodput-ratio", type=float, default=None)
    r.add_argument("--max-failure-rate", type=float, default=None,
                   help="exit 1 when failed/total is above this (e.g. 0 for any failure)")
    r.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between /metrics polls for peak gauges (0 = off)")
    r.add_argument("--result-file", default=None, help="write the JSON result here")
    r.add_argument("--save-result", action="store_true",
                   help="write the JSON result into --result-dir under an automatic name")
    r.add_argument("--result-dir", default=".")
    r.add_argument("--save-text", action="store_true", help="keep generated text in the records")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument("--label", default=None)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    base = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat"
                                 else "/v1/completions")
    return BenchConfig(
        base_url=base, endpoint=endpoint, model=args.model,
        api_key=os.environ.get("OPENAI_API_KEY") or None, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, burstiness=args.burstiness, duration=args.duration,
        num_warmups=args.num_warmups, ignore_eos=args.ignore_eos, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k,
        extra_body=json.loads(args.extra_body) if args.extra_body else {},
        request_timeout=args.request_timeout, seed=args.seed,
        percentiles=tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip()),
        goodput=parse_goodput(args.goodput), metrics_interval=args.metrics_interval,
        disable_tqdm=args.disable_tqdm, save_text=args.save_text, label=args.label)


async def _prepare(cfg: BenchConfig) -> tuple[dict[str, Any], str | None]:
    async with make_client(cfg, 4) as client:
        health = await check_health(client)
        model = cfg.model or await discover_model(client, cfg)
    return health, model


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `specserve bench serve ...`
        argv = argv[1:]
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (ValueError, json.JSONDecodeError) as exc:
        parser.error(str(exc))
    if args.duration and args.num_prompts is None and math.isinf(cfg.request_rate) \
            and not cfg.max_concurrency:
        parser.error("--duration without --num-prompts needs --request-rate or --max-concurrency")
    health, model = asyncio.run(_prepare(cfg))
    if not health["ok"]:
        print(f"bench_serve: warning: {cfg.base_url}/health: "
              f"{health['error'] or health['status']}", file=sys.stderr)
    if model is None:
        print(f"bench_serve: error: no model from {cfg.base_url}/v1/models; pass --model",
              file=sys.stderr)
        return 2
    cfg.model = model
    tokenizer = load_tokenizer(args.tokenizer or model)
    n = args.num_prompts if args.num_prompts is not None else (1000 if args.duration else 100)
    requests = dataset_requests(args, n, tokenizer, cfg.chat)
    bound = f"{n} requests" if args.num_prompts is not None or not args.duration else "no count"
    if args.duration:
        bound += f", {args.duration:g} s"
    print(f"bench_serve: {cfg.base_url}{cfg.endpoint} model={model} "
          f"dataset={args.dataset_name} bound=({bound}) "
          f"concurrency={cfg.max_concurrency or 'unbounded'} rate={cfg.request_rate}",
          file=sys.stderr)
    cycle = bool(args.duration) and args.num_prompts is None  # repeat prompts until time is up
    result = asyncio.run(run_benchmark(cfg, requests, tokenizer, health=health, cycle=cycle))
    result["config"].update(dataset_name=args.dataset_name, num_prompts=args.num_prompts,
                            tokenizer=args.tokenizer, max_failure_rate=args.max_failure_rate,
                            min_goodput_ratio=args.min_goodput_ratio)
    status = exit_status(result, args.max_failure_rate, args.min_goodput_ratio)
    result["exit_status"] = status
    print(format_report(result))
    path = args.result_file
    if path is None and args.save_result:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = str(Path(args.result_dir) / f"bench-serve-{model.replace('/', '_')}-{stamp}.json")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str))
        print(f"bench_serve: result written to {path}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
