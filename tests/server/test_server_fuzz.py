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
    # a timed-out request is a 503/504 error now: the bound only catches hangs
    running: RunningServer = start_server(request_timeout=60)
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


# -- invalid code points in every string field -------------------------------------------

SURROGATES = ["\ud800", "a\ud800b", "\udfff", "x\udc80", "\ud83d", "\ude00\ud83d"]
# valid scalar values that are still odd (NUL, noncharacters, the last code point, format
# characters): they may be refused (400/404) but never break anything
ODD_VALID = "a\x00\ufffe\uffff\U0010ffff\ufdd0\u200b\u202eb"
MSGS = [{"role": "system", "content": "be brief", "name": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
VALID_BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [
        {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stop": ["x", "y"], "user": "u"},
        {"model": MODEL, "prompt": ["Hi", "Yo"], "max_tokens": 1, "stop": "z", "stream": True,
         "suffix": None, "echo": True}],
    "/v1/chat/completions": [
        {"model": MODEL, "messages": MSGS, "max_tokens": 1, "stop": ["x"], "user": "u",
         "chat_template_kwargs": {"enable_thinking": "no"}, "tool_choice": "none",
         "response_format": {"type": "text"}},
        {"model": MODEL, "messages": MSGS, "max_tokens": 1, "stream": True,
         "stream_options": {"include_usage": True}}],
    "/tokenize": [{"model": MODEL, "prompt": "Hi"}, {"model": MODEL, "messages": MSGS}],
    "/detokenize": [{"model": MODEL, "tokens": [1, 2, 3]}],
}


def string_paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Paths of every string in ``value``: values, and dict keys (marked with a ``KEY``)."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield (*path, ("KEY", k))
            yield from string_paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from string_paths(v, (*path, i))


def replaced(body: Any, path: tuple, bad: str) -> Any:
    body = json.loads(json.dumps(body))
    *parents, last = path
    target = body
    for p in parents:
        target = target[p]
    if isinstance(last, tuple):  # a key
        target[bad] = target.pop(last[1])
    else:
        target[last] = bad
    return body


def fuzz_cases() -> Iterator[tuple[str, dict[str, Any], tuple]]:
    for path, bodies in VALID_BODIES.items():
        for body in bodies:
            for where in [*string_paths(body), (("KEY", None),)]:  # + a new top-level key
                yield path, body, where


def test_invalid_code_points_in_every_string_field() -> None:
    """Lone surrogates anywhere (values and keys, every endpoint, streaming or not) are a 400
    with the OpenAI error body, and the keep-alive connection stays usable; other odd code
    points never give a 5xx."""
    import http.client

    running = start_server()
    try:
        host, port = running.base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {"Content-Type": "application/json"}

        def post(path: str, raw: bytes) -> tuple[int, bytes, bool]:
            conn.request("POST", path, body=raw, headers=headers)
            r = conn.getresponse()
            return r.status, r.read(), r.will_close

        conn.request("GET", "/v1/models")
        conn.getresponse().read()
        sock = conn.sock
        cases = 0
        for path, body, where in fuzz_cases():
            odd = [ODD_VALID] if not isinstance(where[-1], tuple) else []
            for bad in SURROGATES + odd:
                if where == (("KEY", None),):
                    doc = {**body, bad: "x"}
                else:
                    doc = replaced(body, where, bad)
                status, data, closing = post(path, json.dumps(doc).encode())  # \ud800 escapes
                cases += 1
                info = (path, where, bad, status, data[:300])
                assert status < 500 and not closing, info
                assert conn.sock is sock, info  # the same connection, never reset
                if status != 200:
                    err = json.loads(data)["error"]
                    assert set(err) == {"message", "type", "param", "code"}, info
                    assert err["code"] == status, info
                if bad != ODD_VALID:
                    assert status == 400, info
                    assert "surrogate" in err["message"], info
        # raw bytes that are not UTF-8 at all (an encoded surrogate, a stray byte, an
        # overlong encoding) in a string
        for raw in (b"\xed\xa0\x80", b"\xff", b"\xc0\xaf", b"\xf4\x90\x80\x80"):
            for path in VALID_BODIES:
                status, data, closing = post(
                    path, b'{"model": "' + MODEL.encode() + b'", "prompt": "a' + raw + b'b"}')
                assert status == 400 and not closing and conn.sock is sock, (path, raw, data)
                assert json.loads(data)["error"]["code"] == 400
        assert cases > 300
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert r.status == 200 and r.read() and conn.sock is sock
        # the 404 handler itself copes with a surrogate in a path
        conn.request("GET", "/v1/models/%ED%A0%80")
        r = conn.getresponse()
        assert r.status == 404 and json.loads(r.read())["error"]["code"] == 404
        conn.close()
    finally:
        running.stop()


def test_model_not_found_message_survives_surrogates() -> None:
    from server.errors import error_body, model_not_found

    err = model_not_found("\ud800x")
    body = json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # what is sent
    assert b"\\ud800x" in body
    assert json.dumps(error_body("a\udfff", 400, "p\ud800"), ensure_ascii=False).encode()
