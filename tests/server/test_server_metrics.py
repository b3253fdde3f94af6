"""``/metrics``: Prometheus text with vLLM's names; counters move with the traffic, the
speculative-decoding counters included (ngram speculation)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from srvutil import MODEL, RunningServer, start_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}  # verifies every step
# Repetitive text: prompt-lookup drafts get accepted.
PROMPT = "a b c d e f g a b c d e f g a b c d e f g a b c d e f g a b c"

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:num_preemptions", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos", "specserve:spec_decode_verify_steps")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds")


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server(engine={"speculative_config": NGRAM})
    yield running
    running.stop()


def test_exposition_parses_with_vllm_names_and_labels(srv: RunningServer) -> None:
    r = httpx.get(srv.url("/metrics"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in GAUGES:
        assert families[name].type == "gauge"
    for name in COUNTERS:
        assert families[name].type == "counter", name
        assert all(s.name == name + "_total" for s in families[name].samples)
    for name in HISTOGRAMS:
        assert families[name].type == "histogram"
    for family in families.values():
        if family.name.startswith("vllm:"):
            for sample in family.samples:
                assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    positions = [s.labels["position"]
                 for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples]
    assert positions == ["0", "1", "2"]
    ks = [s.labels["k"] for s in families["specserve:spec_decode_verify_steps"].samples]
    assert ks == ["0", "1", "2", "3"]
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["block_size"] == "128"  # the default on the CPU
    assert int(info.labels["num_gpu_blocks"]) > 0


def test_counters_move_with_requests(srv: RunningServer) -> None:
    before = srv.metrics()
    out = httpx.post(srv.url("/v1/completions"), timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}).json()
    chat = httpx.post(srv.url("/v1/chat/completions"), timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}).json()
    after = srv.metrics()

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    usage, cusage = out["usage"], chat["usage"]
    assert delta("vllm:prompt_tokens_total{}") == usage["prompt_tokens"] + cusage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total{}") == \
        usage["completion_tokens"] + cusage["completion_tokens"]
    assert delta('vllm:request_success_total{finished_reason="length"}') == 2
    for name in HISTOGRAMS:
        assert delta(name + "_count{}") >= (2 if name != HISTOGRAMS[1] else 1)
    drafts = delta("vllm:spec_decode_num_drafts_total{}")
    draft_tokens = delta("vllm:spec_decode_num_draft_tokens_total{}")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total{}")
    per_pos = [delta(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}')
               for p in range(3)]
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    by_k = [delta(f'specserve:spec_decode_verify_steps_total{{k="{k}"}}') for k in range(4)]
    assert sum(by_k[1:]) == drafts and sum(k * n for k, n in enumerate(by_k)) == draft_tokens
    assert by_k[0] >= 2  # each request's first token comes from its prefill, with no drafts
    assert after["vllm:num_requests_running{}"] == 0
    assert after["vllm:kv_cache_usage_perc{}"] == 0


def test_two_apps_in_one_process_have_separate_registries(srv: RunningServer) -> None:
    from server.app import build_app
    from server.config import ServerConfig

    cfg = srv.state.engine_config
    other = build_app(ServerConfig(("other",)), cfg, lambda: None)  # never started
    assert other.state.specserve.metrics.registry is not srv.state.metrics.registry
    from prometheus_client import generate_latest

    text = generate_latest(other.state.specserve.metrics.registry).decode()
    assert 'model_name="other"' in text and MODEL not in text
