#!/usr/bin/env python
"""Attack a running specserve (or any OpenAI-compatible) server and check it holds up.

Starts nothing: point it at a server started with, for example,
``specserve serve --port 8123 --api-key k --limit-concurrency 64 --max-waiting-requests 16``
and run ``python scripts/attack_check.py --port 8123 --api-key k --limit-concurrency 64
--max-waiting-requests 16 --pid <server pid>``.

Phases: malformed requests (bad JSON, wrong types, lone surrogates in every string field,
huge prompts, unknown model, out-of-range values, malformed HTTP), auth bypass attempts on
every route (with --api-key), 32 concurrent streams with a third disconnecting midway, an
overload burst above --limit-concurrency and --max-waiting-requests, slow clients holding
unfinished headers, and a mixed soak. Every answer is recorded; afterwards /metrics must show
the KV cache empty and nothing running, and the server's RSS is sampled (--pid).

Phases on request (``--phases``): ``timeout`` (a server started with ``--request-timeout S``,
passed here too: long requests alone and in a crowd must end as 503/504 JSON or an SSE error
event, and ``specserve:request_timeouts_total`` must count each), ``seeded`` (seeded sampling
must give the same text alone and amid 24 streams) and ``sigterm`` (last: SIGTERM to --pid
while streams run; every stream must end with ``[DONE]`` after its finish reason or a 503
error event, newcomers get a JSON 503 or a refused connection, and the process must exit).

Exit status 1 on any 5xx other than a 503 with a JSON body and Retry-After, any connection
reset or dropped response, any error body that is not OpenAI-style JSON, any status outside
what a case expects, any timeout, lost output or leaked KV block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

SURROGATES = ("a\ud800b", "\udfff", "\ud800\ud800", "x\udbff")
NONCHARACTERS = ("\ufffe", "\uffff", "a\x00b", "\U0010ffff")
C, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------- pure helpers (unit-tested)

def error_problem(status: int, content_type: str, body: bytes) -> str | None:
    """Why an error response (status >= 400) is not an OpenAI-style JSON error, or None."""
    if "json" not in content_type.lower():
        return f"content-type {content_type or 'none'}"
    try:
        data = json.loads(body)
    except ValueError:
        return "body is not JSON"
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or set(err) != ERROR_KEYS:
        return "not {'error': {message, type, param, code}}"
    if err["code"] != status or not isinstance(err["message"], str) or not err["message"]:
        return "code or message wrong"
    return None


def is_intended_503(status: int, headers: dict[str, str], problem: str | None) -> bool:
    return status == 503 and problem is None and "retry-after" in headers


def string_paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Paths of every string leaf (dict values and list items) in a JSON-like value."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, sub in value.items():
            yield from string_paths(sub, (*path, key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from string_paths(sub, (*path, i))


def replaced(value: Any, path: tuple, new: Any) -> Any:
    """A copy of ``value`` with the leaf at ``path`` set to ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (replaced(v, rest, new) if k == head else v) for k, v in value.items()}
    return [replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name: value}, summing over label sets (enough for gauges here)."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] += float(value)
        except ValueError:
            continue
    return dict(out)


def parse_sse(body: str) -> tuple[list[Any], bool]:
    """(events, ended with [DONE]) of an SSE body; JSON events decoded."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events, bool(events) and events[-1] == "[DONE]"


def sse_outcome(events: list[Any]) -> tuple[list[str], list[Any]]:
    """(finish reasons, error codes) of a parsed SSE body, for checking how a stream ended."""
    finished = [c.get("finish_reason") for e in events if isinstance(e, dict)
                for c in e.get("choices", []) if c.get("finish_reason")]
    codes = [e["error"].get("code") for e in events if isinstance(e, dict) and "error" in e]
    return finished, codes


# ---------------------------------------------------------------- recording

@dataclass
class Tally:
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def problem(self, phase: str, kind: str, detail: str) -> None:
        self.counts[phase][kind] += 1
        if len(self.problems[kind]) < 8:
            self.problems[kind].append(f"[{phase}] {detail}")

    def record(self, phase: str, what: str, status: int, headers: dict[str, str],
               body: bytes | None, expect: set[int] | None = None) -> None:
        """One answer; ``body`` None when there is none to check (HEAD, a stream)."""
        self.statuses[phase][status] += 1
        self.counts[phase]["requests"] += 1
        bad = error_problem(status, headers.get("content-type", ""), body) \
            if status >= 400 and body is not None else None
        if bad is not None:
            self.problem(phase, "non_json_error", f"{what}: {status} {bad}: {body[:120]!r}")
        expected_5xx = expect is not None and status in expect and bad is None
        if status >= 500 and not expected_5xx and not is_intended_503(status, headers, bad):
            self.problem(phase, "unexpected_5xx", f"{what}: {status} {body[:160]!r}")
        if status == 503 and is_intended_503(status, headers, bad):
            self.counts[phase]["intended_503"] += 1
        if expect is not None and status not in expect and status != 503:
            self.problem(phase, "wrong_status", f"{what}: {status} not in {sorted(expect)}: "
                         f"{body[:120]!r}")

    def transport(self, phase: str, what: str, exc: BaseException) -> None:
        self.counts[phase]["requests"] += 1
        kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "reset"
        self.statuses[phase][kind] += 1
        self.problem(phase, kind, f"{what}: {type(exc).__name__}: {exc}")

    def failures(self) -> dict[str, int]:
        total: Counter = Counter()
        for c in self.counts.values():
            total.update(c)
        return {k: total[k] for k in ("unexpected_5xx", "reset", "timeout", "non_json_error",
                                      "wrong_status", "lost_output", "kv_leak",
                                      "nondeterministic", "miscounted", "no_exit") if total[k]}


# ---------------------------------------------------------------- the attack

class Attack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = f"http://{args.host}:{args.port}"
        self.auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.tally = Tally()
        self.model = "unknown"
        self.rss: list[tuple[str, float]] = []
        self.rng = random.Random(args.seed)

    def client(self, **kw: Any) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(base_url=self.base, headers=self.auth, limits=limits,
                                 timeout=self.args.timeout, **kw)

    def sample_rss(self, label: str) -> None:
        if not self.args.pid:
            return
        try:
            with open(f"/proc/{self.args.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        self.rss.append((label, int(line.split()[1]) / 1024))
        except OSError as exc:
            print(f"cannot read RSS of pid {self.args.pid}: {exc}", file=sys.stderr)

    async def send(self, http: httpx.AsyncClient, phase: str, what: str, method: str,
                   path: str, *, expect: set[int] | None = None,
                   **kw: Any) -> httpx.Response | None:
        if "json" in kw:  # ASCII-escaped: lone surrogates travel as \ud800 escapes
            kw["content"] = json.dumps(kw.pop("json")).encode()
            kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
        try:
            r = await http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            self.tally.transport(phase, what, exc)
            return None
        body = None if method == "HEAD" else r.content
        self.tally.record(phase, what, r.status_code, dict(r.headers), body, expect)
        return r

    # -- phase 1: malformed requests
    def malformed_cases(self) -> list[tuple[str, str, str, dict, set[int]]]:
        """(name, method, path, httpx kwargs, expected statuses)."""
        m, lim = self.model, self.args
        comp = {"model": m, "prompt": "Hello", "max_tokens": 1, "stop": ["x", "y"],
                "user": "u"}
        lists = {"model": m, "prompt": ["one", "two"], "max_tokens": 1, "stop": "z"}
        chat = {"model": m, "max_tokens": 1, "stop": "q", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"},
            {"role": "assistant", "content": "ok"}]}
        tok = {"model": m, "prompt": "hello"}
        tokchat = {"model": m, "messages": [{"role": "user", "content": "hi"}]}
        cases: list[tuple[str, str, str, dict, set[int]]] = []

        def j(name: str, path: str, body: Any, expect: set[int]) -> None:
            cases.append((name, "POST", path, {"json": body}, expect))

        def raw(name: str, path: str, data: bytes, expect: set[int],
                ctype: str | None = "application/json") -> None:
            headers = {"Content-Type": ctype} if ctype else {}
            cases.append((name, "POST", path, {"content": data, "headers": headers}, expect))

        for path in (C, CHAT, "/tokenize", "/detokenize"):
            raw(f"bad-json {path}", path, b'{"model": "x", "prompt": ', {400})
            raw(f"not-object {path}", path, b"[1, 2]", {400})
            raw(f"empty {path}", path, b"", {400})
            raw(f"invalid-utf8 {path}", path, b'{"prompt": "\xff\xfe"}', {400})
            raw(f"nan {path}", path, b'{"prompt": "a", "temperature": NaN}', {400})
            raw(f"deep {path}", path, b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}",
                {400})
            raw(f"huge-int {path}", path, b'{"max_tokens": 1' + b"0" * 5000 + b"}", {400})
            raw(f"text-plain {path}", path, json.dumps(tok).encode(), {415}, "text/plain")
            raw(f"no-ctype {path}", path, json.dumps(tok).encode(), {415}, None)
            raw(f"surrogate-key {path}", path, b'{"\\ud800": 1, "model": "m"}', {400})
        for name, template, path in (("comp", comp, C), ("comp-list", lists, C),
                                     ("chat", chat, CHAT), ("tok", tok, "/tokenize"),
                                     ("tok-chat", tokchat, "/tokenize"),
                                     ("detok", {"model": m, "tokens": [1, 2]}, "/detokenize")):
            for where in string_paths(template):
                label = ".".join(map(str, where))
                for k, bad in enumerate(SURROGATES):
                    j(f"surrogate {name}.{label}#{k}", path, replaced(template, where, bad),
                      {400})
                if path in (C, CHAT) and where != ("model",):
                    j(f"surrogate-stream {name}.{label}", path,
                      {**replaced(template, where, SURROGATES[0]), "stream": True}, {400})
                for k, odd in enumerate(NONCHARACTERS):
                    ok = {400, 404} if where == ("model",) else {200, 400}
                    j(f"nonchar {name}.{label}#{k}", path, replaced(template, where, odd), ok)
        wrong = [("prompt", 5), ("prompt", ["a", 1]), ("max_tokens", "10"), ("stream", "yes"),
                 ("seed", "42"), ("temperature", "hot"), ("n", 1.5), ("stop", 7),
                 ("logprobs", "3"), ("echo", "true"), ("top_p", [1]), ("model", 3)]
        for key, value in wrong:
            j(f"type {key}={value!r}", C, {**comp, key: value}, {400})
        for key, value in [("messages", "hi"), ("messages", [{"role": 1, "content": "x"}]),
                           ("max_completion_tokens", "5"), ("logprobs", "yes")]:
            j(f"type chat {key}={value!r}", CHAT, {**chat, key: value}, {400})
        values = [("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 10**9), ("n", 0),
                  ("n", 10**20), ("n", 17), ("logprobs", 21), ("top_p", 1.5), ("top_p", 0),
                  ("temperature", -1), ("seed", 2**70), ("top_k", -5), ("min_p", 2),
                  ("repetition_penalty", 0), ("prompt", [-1]), ("prompt", [10**9]),
                  ("prompt", ""), ("prompt", []), ("stop", [""]), ("logit_bias", {"5": 10})]
        for key, value in values:
            j(f"value {key}={str(value)[:20]}", C, {**comp, key: value}, {400})
        j("unknown-model", C, {**comp, "model": "nope"}, {404})
        j("unknown-model chat", CHAT, {**chat, "model": "nope"}, {404})
        j("unknown-model tokenize", "/tokenize", {**tok, "model": "nope"}, {404})
        big = "hello " * 200_000  # 1.2 MB
        j("huge-prompt", C, {**comp, "prompt": big}, {400, 413})
        j("huge-prompt chat", CHAT, {**chat, "messages": [{"role": "user", "content": big}]},
          {400, 413})
        j("huge-prompt tokenize", "/tokenize", {**tok, "prompt": big}, {400, 413})
        j("huge-token-list", C, {**comp, "prompt": list(range(100)) * 1000}, {400})
        j("huge-body", C, {**comp, "prompt": "a" * (5 << 20)}, {413})
        j("too-many-prompts", C, {**comp, "prompt": ["a"] * 65}, {400})
        if lim.max_waiting_requests:
            j("batch-over-queue", C, {**comp, "prompt": ["a"] * (lim.max_waiting_requests + 1)},
              {400})
        cases.append(("unknown-route", "GET", "/v1/nothing", {}, {404}))
        cases.append(("wrong-method", "GET", C, {}, {405}))
        return cases

    RAW_HTTP: list[tuple[str, bytes]] = [
        ("garbage-request-line", b"HELLO\r\n\r\n"),
        ("bad-version", b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n"),  # h11: 1.1
        ("non-ascii-path", b"GET /v1/mod\xc3\xa9ls HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("bad-header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n"),
        ("two-lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                        b"Content-Length: 3\r\n\r\n{}"),
        ("bad-content-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               b"application/json\r\nContent-Length: abc\r\n\r\n{}"),
        ("bad-chunked", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                        b"chunked\r\nContent-Type: application/json\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n"),
    ]

    async def raw_http(self, phase: str, name: str, data: bytes) -> None:
        """Send bytes on a fresh socket; record the answer's status and body."""
        auth = f"Authorization: Bearer {self.args.api_key}\r\n".encode() if self.args.api_key \
            else b""
        auth += b"Connection: close\r\n"
        if data.count(b"\r\n") > 1:
            head, sep, rest = data.partition(b"\r\n")
            data = head + sep + auth + rest
        try:
            reader, writer = await asyncio.open_connection(self.args.host, self.args.port)
            writer.write(data)
            await writer.drain()
            reply = await asyncio.wait_for(reader.read(), self.args.timeout)
            writer.close()
        except (OSError, asyncio.TimeoutError) as exc:
            self.tally.transport(phase, name, httpx.ReadError(repr(exc)))
            return
        head, _, body = reply.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            self.tally.problem(phase, "reset", f"{name}: no HTTP answer: {reply[:80]!r}")
            return
        headers = {}
        for line in lines[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0] if b"\r\n" in body \
                else body
        expect = {200, 400, 505} if name == "bad-version" else {400}
        self.tally.record(phase, name, status, headers, body, expect)

    async def phase_malformed(self) -> None:
        async with self.client() as http:
            for name, method, path, kw, expect in self.malformed_cases():
                await self.send(http, "malformed", name, method, path, expect=expect, **kw)
                if name.startswith("surrogate"):  # the keep-alive connection still works
                    await self.send(http, "malformed", f"after {name}", "GET", "/v1/models",
                                    expect={200})
        for name, data in self.RAW_HTTP:
            await self.raw_http("malformed", name, data)

    # -- phase 2: auth
    ROUTES = [("GET", "/v1/models"), ("POST", C), ("POST", CHAT), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"),
              ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
              ("GET", "/docs/oauth2-redirect"), ("GET", "/v1/nothing")]

    async def phase_auth(self) -> None:
        key = self.args.api_key
        if not key:
            return
        bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                       {"Authorization": f"Basic {key}"}, {"Authorization": f"Bearer {key}x"},
                       {"Authorization": f"Bearer {key[:-1]}"}, {"X-API-Key": key},
                       {"Authorization": "Bearer"}, {"Authorization": f"Token {key}"},
                       {"Authorization": f"Bearer {key}\u00e9"}]
        body = {"model": self.model, "prompt": "a", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=self.base, timeout=self.args.timeout) as http:
            for method, path in self.ROUTES:
                kw: dict[str, Any] = {"json": body} if method == "POST" else {}
                for i, headers in enumerate(bad_headers):
                    try:
                        r = await http.request(method, path, headers=headers, **kw)
                    except (httpx.LocalProtocolError, UnicodeEncodeError):
                        continue  # the client refuses to send it: nothing to test
                    except httpx.HTTPError as exc:
                        self.tally.transport("auth", f"{method} {path} #{i}", exc)
                        continue
                    self.tally.record("auth", f"{method} {path} #{i}", r.status_code,
                                      dict(r.headers), r.content, {401})
                for suffix in ("?api_key=" + key, "?key=" + key):
                    await self.send(http, "auth", f"{path}{suffix}", method, path + suffix,
                                    expect={401}, **kw)
            tricks = ["/health/../v1/models", "//v1/models", "/v1/models/", "/V1/MODELS",
                      "/v1%2Fmodels", "/%761/models", "/health%00", "/./v1/models",
                      "/ping/../metrics", "/health/"]
            for path in tricks:
                await self.send(http, "auth", f"path {path}", "GET", path,
                                expect={401, 404, 400})
            await self.send(http, "auth", "HEAD models", "HEAD", "/v1/models", expect={401})
            await self.send(http, "auth", "OPTIONS completions", "OPTIONS", C,
                            expect={401, 405, 200, 204})
            for path in ("/health", "/ping"):
                await self.send(http, "auth", f"open {path}", "GET", path, expect={200})
            for method, path in self.ROUTES:  # the key itself works everywhere
                kw = {"json": body} if method == "POST" else {}
                expect = {404} if path == "/v1/nothing" else {200, 400}
                await self.send(http, "auth", f"keyed {method} {path}", method, path,
                                headers=self.auth, expect=expect, **kw)

    # -- phase 3: concurrent streams
    async def one_stream(self, http: httpx.AsyncClient, phase: str, i: int,
                         disconnect: bool, max_tokens: int) -> None:
        chat = i % 2 == 1
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": True, "temperature": 0.7 if i % 4 else 0,
                                "seed": i}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Count to {i + 3}."}]
        else:
            body["prompt"] = f"Story number {i}: once upon a time"
        path = CHAT if chat else C
        what = f"stream {i}{' (disconnects)' if disconnect else ''}"
        try:
            async with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    self.tally.record(phase, what, r.status_code, dict(r.headers), r.content,
                                      {200})
                    return
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                    if disconnect and text.count("\n\n") >= 3:
                        self.tally.record(phase, what, 200, dict(r.headers), None, {200})
                        self.tally.counts[phase]["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
        except httpx.HTTPError as exc:
            self.tally.transport(phase, what, exc)
            return
        self.tally.record(phase, what, 200, dict(r.headers), None, {200})
        events, done = parse_sse(text)
        finished, errors = sse_outcome(events)
        if not done or errors or finished not in (["length"], ["stop"]):
            self.tally.problem(phase, "lost_output",
                               f"{what}: done={done} errors={errors[:1]} finish={finished}")

    async def phase_streams(self) -> None:
        n = self.args.streams
        async with self.client() as http:
            await asyncio.gather(*(self.one_stream(http, "streams", i, i % 3 == 0, 16)
                                   for i in range(n)))
        await self.check_idle("streams")

    # -- phase 4: overload burst
    async def one_small(self, http: httpx.AsyncClient, phase: str, i: int) -> None:
        body = {"model": self.model, "prompt": f"Burst {i}", "max_tokens": 4,
                "ignore_eos": True}
        r = await self.send(http, phase, f"burst {i}", "POST", C, json=body, expect={200})
        if r is not None and r.status_code == 200:
            choices = r.json().get("choices", [])
            if len(choices) != 1 or choices[0].get("finish_reason") != "length":
                self.tally.problem(phase, "lost_output", f"burst {i}: {r.text[:120]}")

    async def phase_burst(self) -> None:
        n = self.args.limit_concurrency + (self.args.max_waiting_requests or 0) + 48
        async with self.client() as http:
            await asyncio.gather(*(self.one_small(http, "burst", i) for i in range(n)))
            streams = [self.one_stream(http, "burst", i, False, 8)
                       for i in range(self.args.limit_concurrency + 16)]
            await asyncio.gather(*streams)
        await self.check_idle("burst")

    # -- phase 5: slow clients
    async def phase_slow(self) -> None:
        n, wait = self.args.slow_clients, self.args.header_timeout + 3
        socks: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for i in range(n):
            try:
                reader, writer = await asyncio.open_connection(self.args.host, self.args.port)
            except OSError as exc:
                self.tally.transport("slow", f"slow connect {i}", httpx.ConnectError(repr(exc)))
                continue
            if i % 2 == 0:  # half send a partial head, half nothing at all
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")
            socks.append((reader, writer))
        start = time.monotonic()
        async with self.client() as http:  # the server still serves others meanwhile
            r = await self.send(http, "slow", "request while slow clients wait", "POST", C,
                                json={"model": self.model, "prompt": "Hi", "max_tokens": 2},
                                expect={200})
            self.tally.counts["slow"]["served_during_s_x1000"] = int(
                1000 * (time.monotonic() - start)) if r is not None else -1

        async def outcome(i: int, reader: asyncio.StreamReader) -> None:
            try:
                reply = await asyncio.wait_for(reader.read(), wait)
            except asyncio.TimeoutError:
                self.tally.problem("slow", "timeout", f"slow client {i} kept past {wait}s")
                return
            except OSError as exc:
                self.tally.problem("slow", "reset", f"slow client {i}: {exc!r}")
                return
            if not reply:
                self.tally.counts["slow"]["closed_silently"] += 1
                return
            head, _, body = reply.partition(b"\r\n\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (ln.decode("latin-1").partition(":") for ln in head.split(b"\r\n")[1:])}
            try:
                status = int(head.split()[1])
            except (IndexError, ValueError):
                self.tally.problem("slow", "reset", f"slow client {i}: {reply[:80]!r}")
                return
            self.tally.record("slow", f"slow client {i}", status, headers, body, {408})

        await asyncio.gather(*(outcome(i, r) for i, (r, _) in enumerate(socks)))
        for _, writer in socks:
            writer.close()
        self.tally.counts["slow"]["held_s"] = round(time.monotonic() - start)

    # -- phase 6: mixed soak
    async def soak_one(self, http: httpx.AsyncClient, k: int) -> None:
        kind = self.rng.choice(["comp", "chat", "stream", "stream-drop", "bad", "tokenize",
                                "n2", "models", "metrics", "surrogate"])
        m = self.model
        if kind in ("stream", "stream-drop"):
            await self.one_stream(http, "soak", k, kind == "stream-drop", 8)
        elif kind == "comp":
            await self.one_small(http, "soak", k)
        elif kind == "chat":
            await self.send(http, "soak", "chat", "POST", CHAT, expect={200}, json={
                "model": m, "max_tokens": 6, "messages": [{"role": "user", "content": "Hi"}]})
        elif kind == "n2":
            await self.send(http, "soak", "n=2", "POST", C, expect={200}, json={
                "model": m, "prompt": "Two ways", "max_tokens": 4, "n": 2, "seed": k})
        elif kind == "bad":
            await self.send(http, "soak", "bad", "POST", C, expect={400},
                            json={"model": m, "prompt": "x", "max_tokens": -1})
        elif kind == "surrogate":
            await self.send(http, "soak", "surrogate", "POST", CHAT, expect={400}, json={
                "model": m, "messages": [{"role": "user", "content": "a\ud800"}]})
        elif kind == "tokenize":
            await self.send(http, "soak", "tokenize", "POST", "/tokenize", expect={200},
                            json={"model": m, "prompt": "hello " * 50})
        else:
            await self.send(http, "soak", kind, "GET",
                            "/v1/models" if kind == "models" else "/metrics", expect={200})

    async def phase_soak(self) -> None:
        deadline = time.monotonic() + self.args.soak
        next_rss = time.monotonic()
        counter = iter(range(10**9))

        async def worker(http: httpx.AsyncClient) -> None:
            while time.monotonic() < deadline:
                await self.soak_one(http, next(counter))

        async def sampler() -> None:
            nonlocal next_rss
            while time.monotonic() < deadline:
                if time.monotonic() >= next_rss:
                    self.sample_rss(f"soak +{self.args.soak - (deadline - time.monotonic()):.0f}s")
                    next_rss += 15
                await asyncio.sleep(0.5)

        async with self.client() as http:
            await asyncio.gather(sampler(), *(worker(http)
                                              for _ in range(self.args.soak_concurrency)))
        await self.check_idle("soak")

    # -- phase 7: --request-timeout (a server started with it; --request-timeout here too)
    async def long_stream(self, http: httpx.AsyncClient, phase: str, what: str,
                          body: dict[str, Any]) -> tuple[list[str], list[Any]] | None:
        """Stream ``body``; (finish reasons, error codes) of a 200 that ended with [DONE],
        None (after recording why) otherwise."""
        try:
            async with http.stream("POST", C if "prompt" in body else CHAT,
                                   json={**body, "stream": True}) as r:
                text = (await r.aread()).decode()
        except httpx.HTTPError as exc:
            self.tally.transport(phase, what, exc)
            return None
        self.tally.record(phase, what, r.status_code, dict(r.headers),
                          None if r.status_code == 200 else text.encode(), {200})
        if r.status_code != 200:
            return None
        events, done = parse_sse(text)
        if not done:
            self.tally.problem(phase, "lost_output", f"{what}: no [DONE]: {text[-160:]!r}")
            return None
        return sse_outcome(events)

    async def phase_timeout(self) -> None:
        limit = self.args.request_timeout
        if not limit:
            raise SystemExit("the timeout phase needs --request-timeout (the server's value)")
        before = (await self.metrics()).get("specserve:request_timeouts_total", 0.0)
        long = {"model": self.model, "prompt": "Tell a very long story.", "ignore_eos": True,
                "max_tokens": 4000}
        answered = 0  # requests the server should count as timed out
        async with self.client() as http:
            r = await self.send(http, "timeout", "long, alone", "POST", C, json=long,
                                expect={504})  # a 5xx a case expects must still be JSON
            answered += r is not None and r.status_code in (503, 504)
            out = await self.long_stream(http, "timeout", "long stream, alone", long)
            if out is not None:
                finished, codes = out
                answered += 1
                if finished or codes != [504]:
                    self.tally.problem("timeout", "lost_output",
                                       f"stream past the timeout: finish={finished} "
                                       f"errors={codes}")
            # a crowd above max_num_seqs: some time out waiting (503), some generating (504)
            # as many as run at once plus a full queue: the queued ones time out waiting
            crowd = self.args.max_num_seqs + (self.args.max_waiting_requests or 16)
            results = await asyncio.gather(*(
                self.send(http, "timeout", f"crowd {i}", "POST", C, expect={504},
                          json={**long, "prompt": f"Story {i}: it began"})
                for i in range(crowd)))
            for r in results:
                if r is None:
                    continue
                waited = r.status_code == 503 and "timed out" in r.text
                kind = "503_timed_out_waiting" if waited else str(r.status_code)
                self.tally.counts["timeout"][f"crowd_{kind}"] += 1
                answered += r.status_code == 504 or waited
            # a request that fits in the timeout still succeeds
            await self.send(http, "timeout", "short", "POST", C, expect={200},
                            json={**long, "max_tokens": 2})
        after = (await self.metrics()).get("specserve:request_timeouts_total", 0.0)
        self.tally.counts["timeout"]["counted"] = int(after - before)
        if int(after - before) != answered:
            self.tally.problem("timeout", "miscounted",
                               f"{answered} requests timed out, the counter moved {after - before}")
        await self.check_idle("timeout")

    # -- phase 8: seeded sampling is the same alone and under load
    def seeded_bodies(self) -> list[tuple[str, str, dict[str, Any]]]:
        m, out = self.model, []
        for seed in (1, 22, 333):
            out.append((f"completion seed {seed}", C, {
                "model": m, "prompt": f"A list of {seed % 7 + 3} fruits:", "max_tokens": 24,
                "temperature": 0.9, "top_p": 0.95, "seed": seed}))
            out.append((f"chat n=2 seed {seed}", CHAT, {
                "model": m, "max_tokens": 24, "temperature": 1.0, "top_k": 50, "n": 2,
                "seed": seed, "messages": [{"role": "user", "content": "Name a colour."}]}))
        return out

    async def seeded_texts(self, http: httpx.AsyncClient, what: str, path: str,
                           body: dict[str, Any]) -> list[str] | None:
        for _ in range(20):  # a full queue (503 + Retry-After) is not the question here
            r = await self.send(http, "seeded", what, "POST", path, json=body, expect={200})
            if r is None or r.status_code != 503:
                break
            await asyncio.sleep(0.5)
        if r is None or r.status_code != 200:
            return None
        return [c.get("text", c.get("message", {}).get("content")) for c in r.json()["choices"]]

    async def phase_seeded(self) -> None:
        bodies = self.seeded_bodies()
        async with self.client() as http:
            alone = [await self.seeded_texts(http, w, p, b) for w, p, b in bodies]
            for round_ in range(2):
                load = [self.one_stream(http, "seeded", 1000 + 32 * round_ + i, False, 64)
                        for i in range(24)]
                order = self.rng.sample(range(len(bodies)), len(bodies))

                async def seeded_under_load() -> list[list[str] | None]:
                    await asyncio.sleep(1.0)  # once the streams are running
                    return await asyncio.gather(*(self.seeded_texts(http, *bodies[k])
                                                  for k in order))

                results, *_ = await asyncio.gather(seeded_under_load(), *load)
                for k, texts in zip(order, results):
                    if texts is None or alone[k] is None:
                        continue
                    self.tally.counts["seeded"]["compared"] += 1
                    if texts != alone[k]:
                        self.tally.problem("seeded", "nondeterministic",
                                           f"{bodies[k][0]} (round {round_}): alone "
                                           f"{alone[k]!r} under load {texts!r}")
        await self.check_idle("seeded")

    # -- phase 9 (last): SIGTERM while streams run (--pid; the server exits)
    async def phase_sigterm(self) -> None:
        if not self.args.pid:
            raise SystemExit("the sigterm phase needs --pid")
        phase, pid = "sigterm", self.args.pid
        started = asyncio.Event()
        heard = 0
        n_streams = 12

        async def stream(i: int) -> None:
            nonlocal heard
            body = {"model": self.model, "prompt": f"Tale {i}:", "max_tokens": 40 + 40 * i,
                    "ignore_eos": True, "stream": True}  # some finish within a drain
            what, text, counted = f"stream {i}", "", False
            try:
                async with http.stream("POST", C, json=body) as r:
                    async for chunk in r.aiter_text():
                        text += chunk
                        if not counted and text.count("\n\n") >= 2:
                            counted, heard = True, heard + 1
                            if heard == n_streams:
                                started.set()
            except httpx.HTTPError as exc:
                self.tally.transport(phase, what, exc)
                return
            self.tally.record(phase, what, r.status_code, dict(r.headers),
                              None if r.status_code == 200 else text.encode(), {200})
            if r.status_code != 200:
                return
            events, done = parse_sse(text)
            finished, codes = sse_outcome(events)
            if not done or not (finished == ["length"] or codes == [503]):
                self.tally.problem(phase, "lost_output",
                                   f"{what}: finish={finished} errors={codes} "
                                   f"end={text[-120:]!r}")
            self.tally.counts[phase]["finished" if finished else "aborted_503"] += 1

        async def whole(i: int) -> None:
            body = {"model": self.model, "prompt": f"Fable {i}:", "max_tokens": 400,
                    "ignore_eos": True}
            await self.send(http, phase, f"non-stream {i}", "POST", C, json=body,
                            expect={200, 503})  # finished, or aborted by the drain

        async def newcomer(i: int) -> None:
            try:
                r = await http.post(C, json={"model": self.model, "prompt": "late",
                                             "max_tokens": 2})
            except httpx.ConnectError:  # the listener is closed: refused, not a reset
                self.tally.counts[phase]["refused_after_close"] += 1
                return
            except httpx.HTTPError as exc:
                self.tally.transport(phase, f"newcomer {i}", exc)
                return
            self.tally.record(phase, f"newcomer {i}", r.status_code, dict(r.headers),
                              r.content, {503})

        async def terminate() -> None:
            try:
                await asyncio.wait_for(started.wait(), 60)
            except asyncio.TimeoutError:
                self.tally.problem(phase, "timeout", f"only {heard} streams started in 60 s")
            os.kill(pid, signal.SIGTERM)
            t = time.monotonic()
            await asyncio.sleep(0.2)
            await asyncio.gather(*(newcomer(i) for i in range(4)))
            while os.path.exists(f"/proc/{pid}") and time.monotonic() - t < self.args.exit_wait:
                await asyncio.sleep(0.1)
            if os.path.exists(f"/proc/{pid}"):
                self.tally.problem(phase, "no_exit",
                                   f"pid {pid} still there {self.args.exit_wait} s after SIGTERM")
            self.tally.counts[phase]["exit_ms"] = int(1000 * (time.monotonic() - t))

        async with self.client() as http:
            await asyncio.gather(terminate(), *(stream(i) for i in range(n_streams)),
                                 *(whole(i) for i in range(4)))

    # -- checks
    async def metrics(self) -> dict[str, float]:
        async with httpx.AsyncClient(base_url=self.base, headers=self.auth, timeout=30) as http:
            r = await http.get("/metrics")
            r.raise_for_status()
            return parse_metrics(r.text)

    async def check_idle(self, phase: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            m = await self.metrics()
            busy = {k: m.get(k, 0.0) for k in ("vllm:num_requests_running",
                                               "vllm:num_requests_waiting",
                                               "vllm:kv_cache_usage_perc")}
            if not any(busy.values()):
                return
            if time.monotonic() > deadline:
                self.tally.problem(phase, "kv_leak", f"not idle {timeout}s after {phase}: {busy}")
                return
            await asyncio.sleep(0.2)

    async def run(self) -> int:
        names = self.args.phases.split(",")
        unknown = [n for n in names if not hasattr(self, f"phase_{n}")]
        if unknown:
            raise SystemExit(f"unknown phases {unknown}")
        if "sigterm" in names[:-1]:
            raise SystemExit("sigterm stops the server: it must be the last phase")
        async with self.client() as http:
            r = await http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        self.sample_rss("start")
        for name in names:
            t = time.monotonic()
            if name == "sigterm":
                self.sample_rss("before sigterm")
            await getattr(self, f"phase_{name}")()
            self.tally.counts[name]["seconds"] = round(time.monotonic() - t)
            if name != "sigterm":
                self.sample_rss(f"after {name}")
        if names[-1] != "sigterm":
            await self.check_idle("final")
        return self.report()

    def report(self) -> int:
        t = self.tally
        print(f"\n{'phase':<10} {'requests':>8} {'s':>4}  statuses")
        for phase, statuses in t.statuses.items():
            st = " ".join(f"{k}:{v}" for k, v in sorted(statuses.items(), key=str))
            c = t.counts[phase]
            print(f"{phase:<10} {c['requests']:>8} {c['seconds']:>4}  {st}")
        print("\nper phase:", {p: {k: v for k, v in c.items() if k not in ("requests",)}
                               for p, c in t.counts.items()})
        if self.rss:
            print("\nRSS (MiB): " + ", ".join(f"{label} {mib:.1f}" for label, mib in self.rss))
        failures = t.failures()
        print("\nFAILURES:" if failures else "\nno failures", failures or "")
        for kind, examples in t.problems.items():
            for ex in examples:
                print(f"  {kind}: {ex}")
        return 1 if failures else 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", type=int, default=None, help="server pid, to sample its RSS")
    p.add_argument("--limit-concurrency", type=int, default=64,
                   help="the server's --limit-concurrency (sizes the burst)")
    p.add_argument("--max-waiting-requests", type=int, default=16,
                   help="the server's --max-waiting-requests (0 if unbounded)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="the server's --http-header-timeout")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--slow-clients", type=int, default=100)
    p.add_argument("--soak", type=float, default=60.0, help="seconds of mixed soak")
    p.add_argument("--soak-concurrency", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=None,
                   help="the server's --request-timeout (for the timeout phase)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="the server's --max-num-seqs (sizes the timeout phase's crowd)")
    p.add_argument("--exit-wait", type=float, default=60.0,
                   help="seconds the server may take to exit after SIGTERM (sigterm phase)")
    p.add_argument("--phases", default="malformed,auth,streams,burst,slow,soak",
                   help="comma-separated, in order; also timeout (a server with "
                        "--request-timeout), seeded, and sigterm (last: stops the server)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return asyncio.run(Attack(args).run())


if __name__ == "__main__":
    sys.exit(main())
