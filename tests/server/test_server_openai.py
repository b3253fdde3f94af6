"""The official openai client (and raw HTTP) against a real server: the happy paths."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from srvutil import ALIAS, MODEL, RunningServer, sse_events, start_server

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(srv: RunningServer):
    return srv.openai()


def test_models_version_health(srv: RunningServer, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    raw = httpx.get(srv.url("/v1/models")).json()
    assert raw["data"][0]["max_model_len"] == 512
    assert httpx.get(srv.url("/version")).json()["version"]
    health = httpx.get(srv.url("/health"))
    assert health.status_code == 200 and health.content == b""


def test_completion_greedy_usage_matches_tokenize(srv: RunningServer, client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert choice.finish_reason in ("length", "stop") and choice.text
    count = httpx.post(srv.url("/tokenize"), json={"prompt": PROMPT}).json()["count"]
    assert out.usage.prompt_tokens == count
    assert 1 <= out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == count + out.usage.completion_tokens
    # the alias serves the same model; the response names the first served name
    again = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text and again.model == MODEL


def test_completion_stream_matches_non_stream(srv: RunningServer, client) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_format(srv: RunningServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_chat_non_stream_and_stream(srv: RunningServer, client) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                          temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    count = httpx.post(srv.url("/tokenize"), json={"messages": CHAT}).json()["count"]
    assert full.usage.prompt_tokens == count
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert sum(f is not None for f in finishes) == 1 and finishes[-1] is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_default_max_tokens_and_text_parts(client) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
             {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    out = client.chat.completions.create(model=MODEL, messages=parts, temperature=0,
                                         max_tokens=6)
    assert out.choices[0].message.content


def test_n_and_batched_prompts(client) -> None:
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two,"], n=2,
                                    max_tokens=4, temperature=0.8, seed=7,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == sum(len(c.model_extra["token_ids"])
                                              for c in out.choices)
    prompts = [c.model_extra["prompt_token_ids"] for c in out.choices]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert out.usage.prompt_tokens == len(prompts[0]) + len(prompts[2])
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=4,
                                          temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_n_streaming_interleaves_with_one_finish_each(client) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=5,
                                            temperature=1.0, seed=1, stream=True))
    finishes: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            finishes.setdefault(ch.index, []).append(ch.finish_reason)
    assert sorted(finishes) == [0, 1, 2]
    for reasons in finishes.values():
        assert sum(r is not None for r in reasons) == 1 and reasons[-1] is not None


def test_seed_reproducible(client) -> None:
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
              "temperature": 1.0, "top_p": 0.95}
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert a == b
    texts = {c.text for c in client.completions.create(seed=1234, n=2, **kwargs).choices}
    assert a in texts  # choice 0 of n uses the same seed


def test_stop_string_and_stop_token_ids(client) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    c = cut.choices[0]
    assert c.finish_reason == "stop" and c.text == text[: text.index(stop)]
    assert c.model_extra["stop_reason"] == stop
    kept = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    ids = base.choices[0].model_extra["token_ids"]
    target = ids[3]
    by_id = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [target],
                                                  "return_token_ids": True,
                                                  "ignore_eos": True})
    ch = by_id.choices[0]
    assert ch.finish_reason == "stop" and ch.model_extra["stop_reason"] == target
    assert ch.model_extra["token_ids"] == ids[: ids.index(target) + 1]


def test_completion_logprobs(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text
    stream = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                            temperature=0, logprobs=1, stream=True))
    tokens = [t for c in stream for t in (c.choices[0].logprobs.tokens if c.choices and
                                           c.choices[0].logprobs else [])]
    assert tokens == lp.tokens


def test_chat_logprobs(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())


def test_token_prompt_echo_and_extras(srv: RunningServer, client) -> None:
    ids = httpx.post(srv.url("/tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text
    only = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
    extra = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, user="u1", presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.05,
                                           "repetition_penalty": 1.1, "min_tokens": 2})
    assert extra.usage.completion_tokens == 6


def test_tokenize_detokenize_roundtrip(srv: RunningServer) -> None:
    tok = httpx.post(srv.url("/tokenize"),
                     json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == 512
    back = httpx.post(srv.url("/detokenize"), json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == PROMPT
