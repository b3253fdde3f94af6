"""Random request bodies never produce a 5xx, and every error has the OpenAI shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from srvutil import ALIAS, MODEL, RunningServer, start_server

EXAMPLES = 100
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])

leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


VALID_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 0.5),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**32),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "stop": st.one_of(st.text(min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "return_token_ids": st.booleans(),
    "user": st.text(max_size=5),
}
VALID_PROMPT = st.one_of(
    st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=2))
VALID_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=2))})
HEAD = {"model": st.sampled_from([MODEL, ALIAS]), "max_tokens": st.integers(1, 3)}

valid_completion = st.fixed_dictionaries({**HEAD, "prompt": VALID_PROMPT}, optional={
    **VALID_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5)})
valid_chat = st.fixed_dictionaries(
    {**HEAD, "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3)},
    optional={**VALID_SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "max_completion_tokens": st.integers(1, 3),
              "add_generation_prompt": st.booleans()})
KEYS = [*HEAD, *VALID_SAMPLING, "prompt", "messages", "echo", "logprobs", "top_logprobs",
        "best_of", "suffix", "logit_bias", "tools", "tool_choice", "response_format",
        "continue_final_message", "chat_template_kwargs", "max_completion_tokens", "junk"]


def mutated(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid body with one to three fields replaced by arbitrary JSON (or removed)."""
    edits = st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(anything, st.just(...))),
                     min_size=1, max_size=3)

    def apply(pair: tuple[dict[str, Any], list[tuple[str, Any]]]) -> dict[str, Any]:
        body, changes = dict(pair[0]), pair[1]
        for key, value in changes:
            if value is ...:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    return st.tuples(valid, edits).map(apply)


completion_bodies = st.one_of(valid_completion, mutated(valid_completion),
                              st.dictionaries(st.sampled_from(KEYS), anything, max_size=5))
chat_bodies = st.one_of(valid_chat, mutated(valid_chat),
                        st.dictionaries(st.sampled_from(KEYS), anything, max_size=5))


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    running: RunningServer = start_server(request_timeout=1.5)
    with running.http() as client:
        yield client
    running.stop()


def check(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        assert 'data: {"error"' not in r.text
    else:
        assert r.json()["usage"]["total_tokens"] >= 1


@FUZZ_SETTINGS
@given(body=completion_bodies)
def test_fuzz_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    check(http, "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=chat_bodies)
def test_fuzz_chat(http: httpx.Client, body: dict[str, Any]) -> None:
    check(http, "/v1/chat/completions", body)
